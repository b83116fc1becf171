"""`splitspec bench drafter`: how often the drafter is right, and what it costs, on the run's own steps.

Greedy, held-out prompts (``--prompt-set``: or everyday requests, or Spec-Bench's first turns, with the figures per
category too), in one process (run it with one torch thread). The
target first answers every prompt alone (speculation off): that gives the
reference output and t_target_step, the median of its one-token passes. Then
the sequential loop runs every prompt for each k, with every proposal and
every verify pass timed on its real context:

- acceptance at draft position j: accepted at j / steps that drafted >= j
  tokens (vLLM's per-position metric);
- mean accepted length L_k: tokens emitted per verify step (bonus included);
- t_draft_token: median over proposals of seconds / tokens drafted;
  c = t_draft_token / t_target_step; v_k = t_verify(k + 1) / t_target_step.

Ideal speedups over the target alone are upper bounds built from the run's
own steps (as in ``bench engine``): each generation's ideal time is its
measured prefill plus, per step that drafted n tokens, n * min t_draft_token +
min t_verify(n + 1) (sequential: draft, then verify) or max of the two
(overlapped: the next draft hidden behind verification, as if it always
started from the right token), the minima over every such step of the run so
far. No real step is cheaper, so the measured speedup never exceeds the
sequential ideal. The model figures L_k / (k c + v_k) and L_k / max(k c, v_k)
(Leviathan et al., arXiv 2211.17192, Sec. 3.4, with medians) are reported
beside them as ``model_speedup_*``.
"""

from __future__ import annotations

import logging
import statistics

import torch

from services.draft import DraftEngine
from services.drafters import MODEL_DRAFTER, default_kind
from services.eagle_draft import installed_head
from services.loading import LoadedModel
from services.loop import GenerationResult, SpeculationStats, generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.text import chat_ids
from services.verify import VerifyEngine
from splitspec.bench.engine import (
    Arm, StepCosts, TimedDraft, TimedVerify, _draft_vocab_size, _timed, _traced_generate, ideal_seconds,
)

logger = logging.getLogger(__name__)
DEFAULT_KS = (1, 2, 3, 4, 5, 6)


def acceptance_by_position(results: list[GenerationResult], k: int) -> list[float]:
    """Per draft position j = 1..k: accepted at j / steps that drafted at least j tokens (a tree: j deep; a hybrid's
    lookup chain may go deeper than k: positions past k are left out)."""
    drafted, accepted = [0] * k, [0] * k
    for result in results:
        for n in result.depth_per_step:
            for j in range(min(n, k)):
                drafted[j] += 1
        for j, count in enumerate(result.stats.accepted_per_position[:k]):
            accepted[j] += count
    return [accepted[j] / drafted[j] if drafted[j] else 0.0 for j in range(k)]


def model_speedups(mean_len: float, k: int, c: float, v_k: float) -> tuple[float, float]:
    """(sequential, overlapped) speedup of the cost model, in units of one target step (medians: not a bound)."""
    return mean_len / (k * c + v_k), mean_len / max(k * c, v_k)


def _by_category(results: list[GenerationResult], categories: list[str], k: int) -> dict:
    """Per category: mean accepted length, acceptance and acceptance by draft position."""
    out = {}
    for category in dict.fromkeys(categories):
        mine = [r for r, c in zip(results, categories) if c == category]
        stats = SpeculationStats()
        for r in mine:
            stats.merge(r.stats)
        out[category] = {"prompts": len(mine), "mean_accepted_length": round(stats.mean_accepted_length, 3),
                         "acceptance_rate": round(stats.acceptance_rate, 4),
                         "acceptance_by_position": [round(a, 4) for a in acceptance_by_position(mine, k)]}
    return out


def params_of(temperature: float, n: int) -> SamplingParams:
    """Prompt n's sampling: greedy at 0, else ``temperature`` with its own seed (n)."""
    return SamplingParams(temperature=temperature, seed=n if temperature > 0 else None)


def _run_k(k: int, engines, prompts, references, *, max_new_tokens: int, t_target_step: float, off: Arm,
           categories: list[str], temperature: float = 0.0) -> dict:
    prefill, drafts, verify, costs = engines
    n_proposals, n_verify = len(costs.draft_token_s[drafts.drafter]), len(costs.verify_s[k + 1])
    arm, results, identical = Arm(f"k={k}"), [], True
    for n, (ids, ref) in enumerate(zip(prompts, references)):
        result = None

        def run_one(ids=ids, n=n):
            nonlocal result
            result = _traced_generate(prefill, drafts, verify, ids, max_new_tokens=max_new_tokens,
                                      num_draft_tokens=k, params=params_of(temperature, n), drafter=drafts.drafter)
            return result.token_ids

        identical &= _timed(arm, run_one) == ref
        results.append(result)
    stats = SpeculationStats()
    for r in results:
        stats.merge(r.stats)
    t_draft_token = statistics.median(costs.draft_token_s[drafts.drafter][n_proposals:])
    t_verify = statistics.median(costs.verify_s[k + 1][n_verify:])
    mean_len = stats.mean_accepted_length
    c, v_k = t_draft_token / t_target_step, t_verify / t_target_step
    model_sequential, model_overlapped = model_speedups(mean_len, k, c, v_k)
    min_draft, min_verify = min(costs.draft_token_s[drafts.drafter][n_proposals:]), costs.min_verify()
    tokens = sum(len(r.token_ids) for r in results)
    sequential, overlapped = (
        tokens / sum(ideal_seconds(r, min_draft, min_verify, overlapped) for r in results) / off.tok_s
        for overlapped in (False, True)
    )
    return {
        "k": k,
        "acceptance_by_position": [round(a, 4) for a in acceptance_by_position(results, k)],
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(mean_len, 3),
        "t_draft_token_ms": round(t_draft_token * 1000, 3),
        "t_verify_ms": round(t_verify * 1000, 3),
        "draft_cost_ratio": round(c, 4),
        "verify_cost_ratio": round(v_k, 4),
        "ideal_speedup_sequential": round(sequential, 3),
        "ideal_speedup_overlapped": round(overlapped, 3),
        "model_speedup_sequential": round(model_sequential, 3),
        "model_speedup_overlapped": round(model_overlapped, 3),
        "measured_speedup_sequential": round(arm.tok_s / off.tok_s, 3),
        "greedy_identical": identical if temperature == 0 else None,  # (sampled answers differ from the target's run)
        "by_category": _by_category(results, categories, k),
    }


def run(
    target: LoadedModel,
    draft: LoadedModel,
    *,
    ks: list[int] = list(DEFAULT_KS),
    num_prompts: int = 8,
    max_new_tokens: int = 64,
    draft_vocab_size: int | None = None,
    drafter: str | None = None,  # default: the EAGLE head when the drafter folder has one, else the draft model
    prompt_set: str = "held_out",
    temperature: float = 0.0,  # > 0: sampled (each prompt seeded), the drafter drawing from its own q
    progress=print,
) -> dict:
    from splitspec.bench.grpc import labelled_prompts

    labelled = labelled_prompts(prompt_set)[:num_prompts] if num_prompts else labelled_prompts(prompt_set)
    categories = [c for c, _ in labelled]
    prompts = [chat_ids(target.tokenizer, p) for _, p in labelled]
    costs = StepCosts()
    draft_engine = DraftEngine(draft, draft_vocab_size=draft_vocab_size, eagle_head=installed_head(draft, target))
    drafter = drafter or default_kind(draft_engine.drafters)
    if drafter not in draft_engine.drafters:
        raise ValueError(f"drafter {drafter!r} is not available here; this drafter folder offers {list(draft_engine.drafters)}")
    prefill, verify_engine = PrefillEngine(target), VerifyEngine(target)
    generate(prefill, draft_engine, verify_engine, prompts[0], max_new_tokens=8, num_draft_tokens=2, params=SamplingParams(),
             drafter=drafter)  # warm up
    engines = prefill, TimedDraft(draft_engine, costs, drafter), TimedVerify(verify_engine, costs), costs
    # 1. the target alone: the reference output and the cost of one target step
    off, references = Arm("speculation off"), []
    for n, ids in enumerate(prompts):
        references.append(_timed(off, lambda ids=ids, n=n: generate(
            prefill, None, engines[2], ids, max_new_tokens=max_new_tokens, num_draft_tokens=1,
            params=params_of(temperature, n)).token_ids))
    t_target_step = statistics.median(costs.verify_s[1])
    vocab = _draft_vocab_size(draft_engine) if drafter == MODEL_DRAFTER else len(draft_engine.eagle_head.kept_ids)
    progress(f"target alone: {off.tok_s:.2f} tok/s, t_target_step {t_target_step * 1000:.2f} ms; "
             f"drafter head keeps {vocab} of {draft.vocab_size} ids")
    # 2. the speculative loop at each k
    rows = []
    for k in ks:
        row = _run_k(k, engines, prompts, references, max_new_tokens=max_new_tokens, t_target_step=t_target_step, off=off,
                     categories=categories, temperature=temperature)
        rows.append(row)
        progress(f"k={k}: acceptance by position {row['acceptance_by_position']}, rate {row['acceptance_rate']:.1%}, "
                 f"mean accepted length {row['mean_accepted_length']:.2f}; t_draft_token {row['t_draft_token_ms']:.2f} ms "
                 f"(c = {row['draft_cost_ratio']:.3f}), v_k = {row['verify_cost_ratio']:.2f}; ideal "
                 f"{row['ideal_speedup_sequential']:.2f}x sequential, {row['ideal_speedup_overlapped']:.2f}x overlapped; "
                 f"measured {row['measured_speedup_sequential']:.2f}x; identical={row['greedy_identical']}")
        if len(row["by_category"]) > 1:
            for category, part in row["by_category"].items():
                progress(f"  {category}: mean accepted length {part['mean_accepted_length']:.2f}, acceptance by position "
                         f"{part['acceptance_by_position']}")
    report = _report(rows, costs, t_target_step, off, vocab, target, draft, len(prompts), max_new_tokens, drafter)
    report["setup"] |= {"prompt_set": prompt_set, "temperature": temperature}
    return report


def _report(rows, costs: StepCosts, t_target_step: float, off: Arm, vocab: int, target, draft, prompts: int, max_new_tokens: int,
            drafter: str) -> dict:
    t_draft_token = statistics.median(costs.draft_token_s[drafter])
    report = {f"acceptance_rate_k{r['k']}": r["acceptance_rate"] for r in rows}  # issue 8's goal: k = 3
    report |= {f"mean_accepted_length_k{r['k']}": r["mean_accepted_length"] for r in rows}
    report |= {
        "draft_cost_ratio": round(t_draft_token / t_target_step, 4),
        "t_draft_token_ms": round(t_draft_token * 1000, 3),
        "t_target_step_ms": round(t_target_step * 1000, 3),
        "target_tok_s": round(off.tok_s, 3),
        "best_ideal_speedup_sequential": max(r["ideal_speedup_sequential"] for r in rows),
        "best_ideal_speedup_overlapped": max(r["ideal_speedup_overlapped"] for r in rows),
        "greedy_identical": None if rows[0]["greedy_identical"] is None else all(r["greedy_identical"] for r in rows),
        "setup": {
            "prompts": prompts, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "target": target.model_id, "draft": draft.model_id, "drafter": drafter, "draft_vocab_size": vocab,
        },
        "runs": rows,
    }
    return report
