"""`splitspec bench engine`: target alone vs transformers' assisted generation vs the splitspec loop.

All arms run in one process, greedy, on the same prompts, side by side, so
their ratios are meaningful on a noisy machine. The ideal speedup is an upper
bound built from the run's own steps: every draft proposal and every verify
pass of the benchmark is timed, and the ideal time of a run is its measured
prefill plus, for each step that drafted n tokens, n * min t_draft_token +
min t_verify(n + 1), the minima taken over all steps of the benchmark. Each
real step costs at least that, so a run can never beat its ideal.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from services.draft import DraftEngine
from services.drafters import EAGLE_DRAFTER, MODEL_DRAFTER, PROMPT_LOOKUP_DRAFTER
from services.eagle_draft import installed_head
from services.loading import LoadedModel
from services.loop import GenerationResult, SpeculationStats, generate, speculative_decode
from services.models.prompts import held_out_prompts
from services.policy import AcceptanceCounts, AdaptiveK, CostModel
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.text import chat_ids
from services.tree import DraftTree
from services.verify import VerifyEngine

logger = logging.getLogger(__name__)
ADAPTIVE = 0  # the k of a row whose k the adaptive policy picks per step (services.policy)


@dataclass
class Arm:
    name: str
    seconds: float = 0.0
    tokens: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class StepCosts:
    """Wall-clock seconds of each draft proposal and verify pass a run made (real contexts)."""

    draft_token_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # drafter -> per proposal: seconds / tokens
    verify_s: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # tokens scored -> seconds

    def min_verify(self) -> dict[int, float]:
        return {n: min(times) for n, times in sorted(self.verify_s.items())}

    def median_verify(self) -> dict[int, float]:
        return {n: statistics.median(times) for n, times in sorted(self.verify_s.items())}


class TimedDraft:
    """A DraftEngine whose proposals are timed into ``costs``, by drafter."""

    def __init__(self, engine: DraftEngine, costs: StepCosts, drafter: str = MODEL_DRAFTER):
        self.engine, self.costs = engine, costs
        self.drafter = drafter  # the drafter being run (set before each run)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def propose(self, request_id: str, *args, **kwargs):
        """Timed with the verdicts it catches up with (drafting work: EAGLE extends its head there)."""
        start = time.perf_counter()
        proposal = self.engine.propose(request_id, *args, **kwargs)
        seconds = time.perf_counter() - start
        if proposal.token_ids:  # per token of its depth: a tree's side nodes and a lookup beside a chain cost nothing
            self.costs.draft_token_s[self.drafter].append(seconds / depth(proposal))
        return proposal


class TimedVerify:
    """A VerifyEngine whose passes are timed into ``costs`` by the number of tokens scored (k + 1)."""

    def __init__(self, engine: VerifyEngine, costs: StepCosts):
        self.engine, self.costs = engine, costs

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify(self, request_id: str, draft_token_ids: list[int], *args, **kwargs):
        start = time.perf_counter()
        verdict = self.engine.verify(request_id, draft_token_ids, *args, **kwargs)
        self.costs.verify_s[len(draft_token_ids) + 1].append(time.perf_counter() - start)
        return verdict


def _hf_generate(model, prompt_ids, max_new_tokens, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, **kwargs,
        )
    return out[0, len(prompt_ids):].tolist()


def _timed(arm: Arm, fn):
    start = time.perf_counter()
    tokens = fn()
    arm.seconds += time.perf_counter() - start
    arm.tokens += len(tokens)
    return tokens


def depth(proposal) -> int:
    """Draft tokens a proposal's drafter computed one after another: its chain's length, or its tree's depth."""
    return max(DraftTree(tuple(proposal.parents)).depths()) if proposal.parents else len(proposal.token_ids)


def _traced_generate(*args, **kwargs) -> GenerationResult:
    """``generate`` that also records the prefill time and each step's draft tokens and draft depth (for the ideal
    and the acceptance by position)."""
    tokens, stats, finish, drafted_per_step, depth_per_step = [], SpeculationStats(), None, [], []
    start = time.perf_counter()
    prefill_s = 0.0
    for i, step in enumerate(speculative_decode(*args, stats=stats, **kwargs)):
        if i == 0:
            prefill_s = time.perf_counter() - start
        else:
            drafted_per_step.append(step.n_drafted)
            depth_per_step.append(len(step.accepted))  # (a verdict's per position: by depth in a tree)
        tokens += step.token_ids
        finish = step.finish_reason or finish
    result = GenerationResult(tokens, finish, stats)
    result.prefill_s, result.drafted_per_step, result.depth_per_step = prefill_s, drafted_per_step, depth_per_step
    return result


def run(
    target: LoadedModel,
    draft: LoadedModel,
    *,
    ks: list[int],
    num_prompts: int,
    max_new_tokens: int,
    prompt_lookup_k: int = 3,
    progress=print,
) -> dict:
    prompts = [chat_ids(target.tokenizer, p) for p in held_out_prompts()[:num_prompts]]
    costs = StepCosts()
    prefill = PrefillEngine(target)
    draft_engine, verify_engine = DraftEngine(draft, eagle_head=installed_head(draft, target)), VerifyEngine(target)
    greedy = SamplingParams()
    # warm up every path once (untimed)
    _hf_generate(target.model, prompts[0], 4)
    generate(prefill, draft_engine, verify_engine, prompts[0], max_new_tokens=4, num_draft_tokens=2, params=greedy)
    drafts, verify = TimedDraft(draft_engine, costs), TimedVerify(verify_engine, costs)

    target_arm, own_arm = Arm("target alone (transformers generate)"), Arm("splitspec, speculation off")
    references = []
    for ids in prompts:
        references.append(_timed(target_arm, lambda: _hf_generate(target.model, ids, max_new_tokens)))
        _timed(own_arm, lambda: generate(prefill, None, verify, ids, max_new_tokens=max_new_tokens, num_draft_tokens=1, params=greedy).token_ids)
    progress(f"{target_arm.name}: {target_arm.tok_s:.2f} tok/s; {own_arm.name}: {own_arm.tok_s:.2f} tok/s")
    learned = [d for d in (MODEL_DRAFTER, EAGLE_DRAFTER) if d in draft_engine.drafters]  # drafters with a model
    configs = [(d, k) for d in learned for k in ks] + [(d, ADAPTIVE) for d in learned] + [(PROMPT_LOOKUP_DRAFTER, prompt_lookup_k)]
    policy_costs, policy_prior = defaultdict(CostModel), defaultdict(AcceptanceCounts)  # per drafter, as the ingress keeps them
    runs, traces = [], []
    for drafter, k in configs:
        hf_arm, ours = Arm("transformers assisted"), Arm("splitspec loop")
        identical, stats, trace = True, SpeculationStats(), []
        drafts.drafter = drafter
        for ids, ref in zip(prompts, references):
            if drafter == EAGLE_DRAFTER or k == ADAPTIVE:
                hf_kwargs = None  # transformers has no EAGLE heads, and no adaptive k of this kind
            elif drafter == MODEL_DRAFTER:
                draft.model.generation_config.num_assistant_tokens = k
                draft.model.generation_config.num_assistant_tokens_schedule = "constant"
                draft.model.generation_config.assistant_confidence_threshold = 0.0
                hf_kwargs = {"assistant_model": draft.model}
            else:
                hf_kwargs = {"prompt_lookup_num_tokens": k}
            if hf_kwargs is not None:
                _timed(hf_arm, lambda: _hf_generate(target.model, ids, max_new_tokens, **hf_kwargs))
            result = None

            def ours_fn():
                nonlocal result
                policy = AdaptiveK(policy_costs[drafter], policy_prior[drafter], k_max=max(ks)) if k == ADAPTIVE else None
                result = _traced_generate(prefill, drafts, verify, ids, max_new_tokens=max_new_tokens, num_draft_tokens=k or max(ks),
                                          params=greedy, drafter=drafter, policy=policy)
                return result.token_ids

            tokens = _timed(ours, ours_fn)
            identical &= tokens == ref
            stats.merge(result.stats)
            trace.append(result)
        alpha, mean_len = stats.acceptance_rate, stats.mean_accepted_length
        row = {
            "drafter": drafter,
            "k": "adaptive" if k == ADAPTIVE else k,
            "hf_assisted_tok_s": round(hf_arm.tok_s, 3) if hf_arm.seconds else None,
            "splitspec_tok_s": round(ours.tok_s, 3),
            "ratio_vs_target": round(ours.tok_s / target_arm.tok_s, 3),
            "ratio_vs_splitspec_off": round(ours.tok_s / own_arm.tok_s, 3),
            "ratio_vs_hf_assisted": round(ours.tok_s / hf_arm.tok_s, 3) if hf_arm.seconds else None,
            "acceptance_rate": round(alpha, 4),
            "mean_accepted_length": round(mean_len, 3),
            "greedy_identical": identical,
        }
        runs.append(row)
        traces.append((ours, trace))
        hf = f", {row['ratio_vs_hf_assisted']:.2f}x HF assisted {hf_arm.tok_s:.2f}" if hf_arm.seconds else ""
        progress(
            f"{drafter:13s} k={row['k']}: splitspec {ours.tok_s:6.2f} tok/s ({row['ratio_vs_target']:.2f}x target, "
            f"{row['ratio_vs_splitspec_off']:.2f}x splitspec off{hf}), acceptance {alpha:.1%}, "
            f"mean accepted length {mean_len:.2f}, identical={identical}"
        )
    # ideal: the minima over every step of the benchmark are known only now
    min_draft = {d: min(times) for d, times in costs.draft_token_s.items() if d in learned}
    min_verify = costs.min_verify()
    for row, (ours, trace) in zip(runs, traces):
        draft_cost = min_draft.get(row["drafter"], 0.0)  # prompt lookup's cost is not a model's: counted as free
        ideal_tok_s = ours.tokens / sum(ideal_seconds(result, draft_cost, min_verify) for result in trace)
        row["ideal_tok_s"] = round(ideal_tok_s, 3)
        row["ideal_speedup"] = round(ideal_tok_s / target_arm.tok_s, 3)
        row["fraction_of_ideal"] = round(ours.tok_s / ideal_tok_s, 3)
        progress(f"{row['drafter']:13s} k={row['k']}: ideal {ideal_tok_s:.2f} tok/s, {row['fraction_of_ideal']:.0%} reached")
    best = max((r for r in runs if r["drafter"] in learned), key=lambda r: r["splitspec_tok_s"])
    return {
        "target_tok_s": round(target_arm.tok_s, 3),
        "splitspec_no_speculation_tok_s": round(own_arm.tok_s, 3),
        "hf_assisted_tok_s": max(r["hf_assisted_tok_s"] for r in runs if r["drafter"] == MODEL_DRAFTER and r["hf_assisted_tok_s"]),
        "splitspec_tok_s": best["splitspec_tok_s"],
        "acceptance_rate": best["acceptance_rate"],
        "mean_accepted_length": best["mean_accepted_length"],
        "ideal_speedup": best["ideal_speedup"],
        "best_k": best["k"],
        "best_drafter": best["drafter"],
        "speedup_vs_splitspec_off": best["ratio_vs_splitspec_off"],
        "greedy_identical": all(r["greedy_identical"] for r in runs),
        "costs_ms": {  # minima over the run's own steps (what the ideal uses)
            "verify": {n: round(s * 1000, 2) for n, s in min_verify.items()},
            "draft_token": round(min_draft[MODEL_DRAFTER] * 1000, 2),
            "draft_token_by_drafter": {d: round(s * 1000, 2) for d, s in min_draft.items()},
        },
        "costs_ms_median": {
            "verify": {n: round(s * 1000, 2) for n, s in costs.median_verify().items()},
            "draft_token": round(statistics.median(costs.draft_token_s[MODEL_DRAFTER]) * 1000, 2),
            "draft_token_by_drafter": {d: round(statistics.median(costs.draft_token_s[d]) * 1000, 2) for d in learned},
        },
        "setup": {
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "target": target.model_id, "draft": draft.model_id,
            "draft_vocab_size": _draft_vocab_size(draft_engine),
        },
        "runs": runs,
    }


def ideal_seconds(result: GenerationResult, draft_token_s: float, verify_s: dict[int, float], overlapped: bool = False) -> float:
    """A lower bound on one generation's time: its measured prefill plus the cheapest observed costs of its steps
    (drafting its depth then verifying its rows, or with ``overlapped`` the longer of the two)."""
    combine = max if overlapped else (lambda a, b: a + b)
    return result.prefill_s + sum(combine(d * draft_token_s, verify_s[n + 1])
                                  for n, d in zip(result.drafted_per_step, result.depth_per_step, strict=True))


def _draft_vocab_size(engine: DraftEngine) -> int:
    """Ids the drafter's LM head keeps (the full vocabulary when it is not pruned)."""
    return engine.draft.vocab_size if engine.kept_ids is None else int(engine.kept_ids.numel())
