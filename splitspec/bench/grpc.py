"""Tokens/s through the gRPC service, speculation on vs off, measured side by side in one run.

Single stream, greedy, the same held-out prompts for every policy; the
policies take turns prompt by prompt so that machine noise hits all of them
alike, after untimed one-token requests (one a policy) have put the prompt in
the prefix cache (else the first policy to ask for a prompt, or for its
features, would pay its prefill and the others hit). Prints ratios (never asserted in tests: the machines are noisy).

The ideal of a policy is an upper bound for its measured acceptance: every
verify step (k + 1 tokens scored) costs what one step of speculation off
costs, measured in the same run, and drafting costs nothing — so
ideal = off tok/s x tokens per step (prefill's token counted as a step).

The ideal for the measured costs (``add_drafting_ideal``, with the server's
policy state) also charges drafting, at its fastest measured cost: the run
took at least (drafted / tree width) chain tokens (a tree step of k chain
tokens drafts k + width - 1 <= k x width nodes), each costing at least the
least seconds per token of any proposal the server timed (a proposal of k
costs at least k times that) — still an upper bound on what the policy could
reach with its acceptance, as ``splitspec bench engine``'s ideal is.
"""

from __future__ import annotations

import time

import grpc

from services.models.prompts import everyday_prompts, held_out_prompts
from splitspec.api.client import SpecDecodeClient

POLICIES = {
    "off": dict(speculate=False),
    "server default": dict(),  # adaptive k with the server's default drafter, unless its config pins them
    "model k=1": dict(speculate=True, drafter="model", num_draft_tokens=1),
    "model k=2": dict(speculate=True, drafter="model", num_draft_tokens=2),
    "eagle k=1": dict(speculate=True, drafter="eagle", num_draft_tokens=1),
    "eagle k=2": dict(speculate=True, drafter="eagle", num_draft_tokens=2),
    "eagle k=3": dict(speculate=True, drafter="eagle", num_draft_tokens=3),
    "eagle k=4": dict(speculate=True, drafter="eagle", num_draft_tokens=4),
    "prompt_lookup k=3": dict(speculate=True, drafter="prompt_lookup", num_draft_tokens=3),
    "hybrid k=3": dict(speculate=True, drafter="hybrid", num_draft_tokens=3),
    "eagle k=1 overlap": dict(speculate=True, drafter="eagle", num_draft_tokens=1, overlap=True),
    "eagle k=2 overlap": dict(speculate=True, drafter="eagle", num_draft_tokens=2, overlap=True),
    "model k=1 overlap": dict(speculate=True, drafter="model", num_draft_tokens=1, overlap=True),
    "eagle adaptive overlap": dict(speculate=True, drafter="eagle", overlap=True),
    "eagle adaptive sequential": dict(speculate=True, drafter="eagle", overlap=False),
}
PROMPT_SETS = ("held_out", "everyday", "specbench")
CHECK_POLICIES = ["server default"]  # what ``--check`` holds to speculation off unless --policies names others


def labelled_prompts(prompt_set: str) -> list[tuple[str, str]]:
    """(category, prompt): the drafter's held-out prompts or everyday assistant requests (services.models.prompts),
    or Spec-Bench's first turns (services.models.specbench), dealt over its six categories so that any first n are
    spread evenly over them."""
    if prompt_set == "everyday":
        return list(everyday_prompts())
    if prompt_set == "specbench":
        from services.models import specbench

        return [(q.category, q.first_turn) for q in specbench.interleaved()]
    if prompt_set != "held_out":
        raise ValueError(f"unknown prompt set {prompt_set!r}; known: {list(PROMPT_SETS)}")
    return [("held_out", p) for p in held_out_prompts()]


def prompts_of(prompt_set: str) -> list[str]:
    return [p for _, p in labelled_prompts(prompt_set)]


def _totals() -> dict:
    return {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0, "pre_drafts": 0, "hits": 0,
            "ttft_ms": [], "prompts": 0, "drafter": ""}


def _add(t: dict, response, elapsed: float) -> None:
    s = response.speculation_stats
    t["tokens"] += len(response.token_ids)
    t["seconds"] += elapsed
    t["drafted"] += s.drafted
    t["accepted"] += s.accepted
    t["steps"] += s.steps
    t["pre_drafts"] += s.pre_drafts
    t["hits"] += s.pre_draft_hits
    t["ttft_ms"].append(response.timings.ttft_ms)
    t["prompts"] += 1
    t["drafter"] = s.drafter or t["drafter"]  # (what the server drafted with: the server default's, too)


def _tok_s(t: dict | None) -> float:
    return t["tokens"] / t["seconds"] if t and t["seconds"] else 0.0


def _summary(t: dict, off_tok_s: float) -> dict:
    tok_s = _tok_s(t)
    ideal = off_tok_s * t["tokens"] / (t["steps"] + t["prompts"]) if t["steps"] else off_tok_s
    return {
        "tok_s": round(tok_s, 2),
        "ratio_vs_off": round(tok_s / off_tok_s, 3) if off_tok_s else None,
        "acceptance_rate": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
        "mean_accepted_length": round((t["accepted"] + t["steps"]) / t["steps"], 3) if t["steps"] else None,
        "overlap_hit_rate": round(t["hits"] / t["pre_drafts"], 3) if t["pre_drafts"] else None,
        "ideal_tok_s": round(ideal, 2),
        "fraction_of_ideal": round(tok_s / ideal, 3) if ideal else None,
        "median_ttft_ms": round(sorted(t["ttft_ms"])[len(t["ttft_ms"]) // 2], 1) if t["ttft_ms"] else None,
        "tokens": t["tokens"], "steps": t["steps"], "drafted": t["drafted"], "drafter": t["drafter"] or None,
    }


def run(client: SpecDecodeClient, *, num_prompts: int = 8, max_new_tokens: int = 64, warmup: int = 1,
        prompt_set: str = "held_out", policies: list[str] | None = None, check: bool = False,
        progress=None) -> dict:
    """The policies' tok/s, acceptance and answers over the first ``num_prompts`` of ``prompt_set`` (0: all).

    ``check``: a regression run. A failed call is recorded (``errors``: prompt, category, policy, status, message)
    and the run goes on; ``mismatches`` lists the prompts where a policy's greedy answer differs from speculation
    off's; ``ok`` is True when there are neither. Without it a failed call raises. ``progress(done, total)``: called
    after each prompt.
    """
    if policies is None and check:
        policies = CHECK_POLICIES
    unknown = set(policies or ()) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    chosen = {name: p for name, p in POLICIES.items() if name == "off" or not policies or name in policies}
    labelled = labelled_prompts(prompt_set)
    labelled = labelled[:num_prompts] if num_prompts else labelled
    for policy in chosen.values():  # warm every stage and kernel before timing
        for _, prompt in labelled[:warmup]:
            client.generate(messages=[("user", prompt)], max_new_tokens=8, **policy)
    totals = {name: _totals() for name in chosen}
    by_category: dict[str, dict[str, dict]] = {}
    answers: dict[str, list[list[int] | None]] = {name: [] for name in chosen}
    errors = []
    for i, (category, prompt) in enumerate(labelled):
        # the prompt's prefill into the prefix cache first, as each policy asks for it (with the target's features
        # where its drafter reads them): else the first policy of each kind pays it and the others hit
        for policy in chosen.values():
            client.generate(messages=[("user", prompt)], max_new_tokens=1, **policy)
        for name, policy in chosen.items():
            start = time.perf_counter()
            try:
                response = client.generate(messages=[("user", prompt)], max_new_tokens=max_new_tokens, **policy)
            except grpc.RpcError as exc:
                if not check:
                    raise
                errors.append({"prompt": i, "category": category, "policy": name, "code": exc.code().name,
                               "details": exc.details()})
                answers[name].append(None)
                continue
            elapsed = time.perf_counter() - start
            _add(totals[name], response, elapsed)
            _add(by_category.setdefault(category, {}).setdefault(name, _totals()), response, elapsed)
            answers[name].append(list(response.token_ids))
        if progress is not None:
            progress(i + 1, len(labelled))
    report = {"prompts": len(labelled), "prompt_set": prompt_set, "max_new_tokens": max_new_tokens, "policies": {}}
    off = _tok_s(totals["off"])
    report["policies"] = {name: _summary(t, off) for name, t in totals.items()}
    if len(by_category) > 1:
        report["categories"] = {category: {name: _summary(t, _tok_s(per_policy.get("off"))) for name, t in per_policy.items()}
                                for category, per_policy in by_category.items()}
    mismatches = [{"prompt": i, "category": labelled[i][0], "policy": name}
                  for name in chosen if name != "off" for i, (got, want) in enumerate(zip(answers[name], answers["off"]))
                  if got is not None and want is not None and got != want]
    report["greedy_identical"] = not mismatches
    if check:
        report["errors"], report["mismatches"] = errors, mismatches
        report["ok"] = not errors and not mismatches
    return report


def add_drafting_ideal(report: dict, state: dict, tree_width: int) -> None:
    """Each drafting policy's ideal for the measured costs (module docstring): ``ideal_with_drafting_tok_s`` and
    ``fraction_of_ideal_with_drafting``, from the fastest proposals in ``state`` (the ingress's ``policy_state``,
    its own drafters' and its verify replica's) and the server's ``tree_width``."""
    places = [state, state.get("verify_replica") or {}]
    per_token_s = {}  # drafter -> the least seconds per drafted chain token of any timed proposal
    for place in places:
        for drafter, learned in place.items():
            for k, ms in (learned.get("min_propose_ms") or {}).items() if isinstance(learned, dict) else ():
                per_token_s[drafter] = min(per_token_s.get(drafter, float("inf")), ms / 1000 / int(k))
    for r in report["policies"].values():
        drafter = r.get("drafter")  # (the one the server drafted with)
        if not r["drafted"] or drafter not in per_token_s:
            continue
        seconds = r["tokens"] / r["ideal_tok_s"] + r["drafted"] / tree_width * per_token_s[drafter]
        r["ideal_with_drafting_tok_s"] = round(r["tokens"] / seconds, 2)
        r["fraction_of_ideal_with_drafting"] = round(r["tok_s"] * seconds / r["tokens"], 3)


def plot(report: dict, path: str) -> None:
    """A bar chart of tok/s per policy (measured, and the ideal as an outline), with the ratio vs off on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["policies"])
    rows = [report["policies"][n] for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.0))
    x = range(len(names))
    ax.bar(x, [r["ideal_tok_s"] for r in rows], color="none", edgecolor="grey", linestyle="--", label="ideal (upper bound)")
    bars = ax.bar(x, [r["tok_s"] for r in rows], color="tab:blue", label="measured")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['ratio_vs_off']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"splitspec through gRPC: {report['prompts']} {report['prompt_set']} prompts x {report['max_new_tokens']} tokens, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
