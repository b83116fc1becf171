"""Tokens/s through the gRPC service, speculation on vs off, measured side by side in one run.

Single stream, greedy, the same held-out prompts for every policy; the
policies take turns prompt by prompt so that machine noise hits all of them
alike. Prints ratios (never asserted in tests: the machines are noisy).
"""

from __future__ import annotations

import time

from services.models.prompts import held_out_prompts
from splitspec.client import SpecDecodeClient

POLICIES = {
    "off": dict(speculate=False),
    "server default": dict(),  # adaptive k with the server's default drafter, unless its config pins them
    "model k=1": dict(speculate=True, drafter="model", num_draft_tokens=1),
    "model k=2": dict(speculate=True, drafter="model", num_draft_tokens=2),
    "eagle k=1": dict(speculate=True, drafter="eagle", num_draft_tokens=1),
    "eagle k=2": dict(speculate=True, drafter="eagle", num_draft_tokens=2),
    "eagle k=3": dict(speculate=True, drafter="eagle", num_draft_tokens=3),
    "prompt_lookup k=3": dict(speculate=True, drafter="prompt_lookup", num_draft_tokens=3),
    "eagle k=1 overlap": dict(speculate=True, drafter="eagle", num_draft_tokens=1, overlap=True),
    "eagle k=2 overlap": dict(speculate=True, drafter="eagle", num_draft_tokens=2, overlap=True),
    "model k=1 overlap": dict(speculate=True, drafter="model", num_draft_tokens=1, overlap=True),
}
PROMPT_SETS = ("held_out", "everyday")


def prompts_of(prompt_set: str) -> list[str]:
    """The drafter's held-out prompts (services.models.prompts), or everyday assistant requests (prompt_bank)."""
    if prompt_set == "everyday":
        from services.models.prompt_bank import everyday_prompts

        return [p for _, p in everyday_prompts()]
    return held_out_prompts()


def run(client: SpecDecodeClient, *, num_prompts: int = 8, max_new_tokens: int = 64, warmup: int = 1,
        prompt_set: str = "held_out") -> dict:
    prompts = prompts_of(prompt_set)[:num_prompts]
    for policy in POLICIES.values():  # warm every stage and kernel before timing
        for prompt in prompts[:warmup]:
            client.generate(messages=[("user", prompt)], max_new_tokens=8, **policy)
    totals = {name: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0, "pre_drafts": 0, "hits": 0,
                     "ttft_ms": []} for name in POLICIES}
    answers: dict[str, list[list[int]]] = {name: [] for name in POLICIES}
    for prompt in prompts:
        for name, policy in POLICIES.items():
            start = time.perf_counter()
            response = client.generate(messages=[("user", prompt)], max_new_tokens=max_new_tokens, **policy)
            elapsed = time.perf_counter() - start
            t, s = totals[name], response.speculation_stats
            t["tokens"] += len(response.token_ids)
            t["seconds"] += elapsed
            t["drafted"] += s.drafted
            t["accepted"] += s.accepted
            t["steps"] += s.steps
            t["pre_drafts"] += s.pre_drafts
            t["hits"] += s.pre_draft_hits
            t["ttft_ms"].append(response.timings.ttft_ms)
            answers[name].append(list(response.token_ids))
    report = {"prompts": len(prompts), "prompt_set": prompt_set, "max_new_tokens": max_new_tokens, "policies": {}}
    off = totals["off"]["tokens"] / totals["off"]["seconds"]
    for name, t in totals.items():
        tok_s = t["tokens"] / t["seconds"]
        report["policies"][name] = {
            "tok_s": round(tok_s, 2),
            "ratio_vs_off": round(tok_s / off, 3),
            "acceptance_rate": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
            "mean_accepted_length": round((t["accepted"] + t["steps"]) / t["steps"], 3) if t["steps"] else None,
            "overlap_hit_rate": round(t["hits"] / t["pre_drafts"], 3) if t["pre_drafts"] else None,
            "median_ttft_ms": round(sorted(t["ttft_ms"])[len(t["ttft_ms"]) // 2], 1),
        }
    report["greedy_identical"] = all(answers[name] == answers["off"] for name in POLICIES)
    return report
