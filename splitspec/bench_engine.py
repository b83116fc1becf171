"""`splitspec bench engine`: target alone vs transformers' assisted generation vs the splitspec loop.

All arms run in one process, greedy, on the same prompts, side by side, so
their ratios are meaningful on a noisy machine. The ideal speedup comes from
the measured acceptance and the measured costs of one verify pass over n + 1
tokens and of one draft token: the ideal time of a run is its measured prefill
plus, for each step that drafted n tokens, n * t_draft + t_verify(n + 1).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from services.draft import MODEL_DRAFTER, PROMPT_LOOKUP_DRAFTER, DraftEngine
from services.loading import LoadedModel
from services.loop import GenerationResult, SpeculationStats, generate, speculative_decode
from services.models.distill import chat_ids
from services.models.prompts import held_out_prompts
from services.prefill import PrefillEngine
from services.runner import make_runner
from services.sampling import SamplingParams
from services.verify import VerifyEngine

logger = logging.getLogger(__name__)
COST_REPEATS = 9  # timing repeats per measured cost (median taken)
COST_CONTEXT = 160  # context length at which step costs are measured


@dataclass
class Arm:
    name: str
    seconds: float = 0.0
    tokens: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _median_time(fn, repeats: int = COST_REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(target: LoadedModel, draft: LoadedModel, max_n: int) -> dict:
    """Seconds for one verify pass over n tokens (n = 1..max_n) and for one draft token."""
    ctx = torch.randint(0, target.vocab_size, (COST_CONTEXT,), generator=torch.Generator().manual_seed(0))
    runner, cache = make_runner(target), None
    cache = runner.new_cache()
    runner.forward(ctx, cache, last_only=True)
    verify = {}
    for n in range(1, max_n + 1):
        chunk = ctx[:n]

        def step(chunk=chunk):
            runner.forward(chunk, cache)
            cache.crop(COST_CONTEXT)

        step()
        verify[n] = _median_time(step)
    drunner = make_runner(draft)
    dcache = drunner.new_cache()
    drunner.forward(ctx, dcache, last_only=True)

    def draft_step():
        drunner.forward(ctx[:1], dcache, last_only=True)
        dcache.crop(COST_CONTEXT)

    draft_step()
    return {"verify_s": verify, "draft_token_s": _median_time(draft_step)}


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


def _traced_generate(*args, **kwargs) -> GenerationResult:
    """``generate`` that also records the prefill time and each step's draft length (for the ideal)."""
    tokens, stats, finish, drafted_per_step = [], SpeculationStats(), None, []
    start = time.perf_counter()
    prefill_s = 0.0
    for i, step in enumerate(speculative_decode(*args, **kwargs)):
        if i == 0:
            prefill_s = time.perf_counter() - start
        else:
            stats.add(step)
            drafted_per_step.append(step.n_drafted)
        tokens += step.token_ids
        finish = step.finish_reason or finish
    result = GenerationResult(tokens, finish, stats)
    result.prefill_s, result.drafted_per_step = prefill_s, drafted_per_step
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
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    drafts = DraftEngine(draft)
    greedy = SamplingParams()
    # warm up every path once
    _hf_generate(target.model, prompts[0], 4)
    generate(prefill, drafts, verify, prompts[0], max_new_tokens=4, num_draft_tokens=2, params=greedy)

    target_arm, own_arm = Arm("target alone (transformers generate)"), Arm("splitspec, speculation off")
    references = []
    for ids in prompts:
        references.append(_timed(target_arm, lambda: _hf_generate(target.model, ids, max_new_tokens)))
        _timed(own_arm, lambda: generate(prefill, None, verify, ids, max_new_tokens=max_new_tokens, num_draft_tokens=1, params=greedy).token_ids)
    progress(f"{target_arm.name}: {target_arm.tok_s:.2f} tok/s; {own_arm.name}: {own_arm.tok_s:.2f} tok/s")
    costs = measure_costs(target, draft, max(*ks, prompt_lookup_k) + 1)
    configs = [(MODEL_DRAFTER, k) for k in ks] + [(PROMPT_LOOKUP_DRAFTER, prompt_lookup_k)]
    runs = []
    for drafter, k in configs:
        hf_arm, ours = Arm("transformers assisted"), Arm("splitspec loop")
        identical, drafted, accepted, steps, ideal_seconds = True, 0, 0, 0, 0.0
        draft_cost = costs["draft_token_s"] if drafter == MODEL_DRAFTER else 0.0
        for ids, ref in zip(prompts, references):
            if drafter == MODEL_DRAFTER:
                draft.model.generation_config.num_assistant_tokens = k
                draft.model.generation_config.num_assistant_tokens_schedule = "constant"
                draft.model.generation_config.assistant_confidence_threshold = 0.0
                hf_kwargs = {"assistant_model": draft.model}
            else:
                hf_kwargs = {"prompt_lookup_num_tokens": k}
            _timed(hf_arm, lambda: _hf_generate(target.model, ids, max_new_tokens, **hf_kwargs))
            result = None

            def ours_fn():
                nonlocal result
                result = _traced_generate(prefill, drafts, verify, ids, max_new_tokens=max_new_tokens, num_draft_tokens=k, params=greedy, drafter=drafter)
                return result.token_ids

            tokens = _timed(ours, ours_fn)
            identical &= tokens == ref
            drafted += result.stats.drafted
            accepted += result.stats.accepted
            steps += result.stats.steps
            ideal_seconds += result.prefill_s + sum(
                n * draft_cost + costs["verify_s"][n + 1] for n in result.drafted_per_step
            )
        alpha = accepted / drafted if drafted else 0.0
        mean_len = (accepted + steps) / steps if steps else 0.0
        ideal_tok_s = ours.tokens / ideal_seconds
        row = {
            "drafter": drafter,
            "k": k,
            "hf_assisted_tok_s": round(hf_arm.tok_s, 3),
            "splitspec_tok_s": round(ours.tok_s, 3),
            "ratio_vs_target": round(ours.tok_s / target_arm.tok_s, 3),
            "ratio_vs_hf_assisted": round(ours.tok_s / hf_arm.tok_s, 3),
            "acceptance_rate": round(alpha, 4),
            "mean_accepted_length": round(mean_len, 3),
            "ideal_tok_s": round(ideal_tok_s, 3),
            "ideal_speedup": round(ideal_tok_s / target_arm.tok_s, 3),
            "fraction_of_ideal": round(ours.tok_s / ideal_tok_s, 3),
            "greedy_identical": identical,
        }
        runs.append(row)
        progress(
            f"{drafter:13s} k={k}: splitspec {ours.tok_s:6.2f} tok/s ({row['ratio_vs_target']:.2f}x target, "
            f"{row['ratio_vs_hf_assisted']:.2f}x HF assisted {hf_arm.tok_s:.2f}), acceptance {alpha:.1%}, "
            f"mean accepted length {mean_len:.2f}, ideal {ideal_tok_s:.2f} tok/s ({row['fraction_of_ideal']:.0%} reached), "
            f"identical={identical}"
        )
    best = max((r for r in runs if r["drafter"] == MODEL_DRAFTER), key=lambda r: r["splitspec_tok_s"])
    return {
        "target_tok_s": round(target_arm.tok_s, 3),
        "splitspec_no_speculation_tok_s": round(own_arm.tok_s, 3),
        "hf_assisted_tok_s": best["hf_assisted_tok_s"],
        "splitspec_tok_s": best["splitspec_tok_s"],
        "acceptance_rate": best["acceptance_rate"],
        "mean_accepted_length": best["mean_accepted_length"],
        "ideal_speedup": best["ideal_speedup"],
        "best_k": best["k"],
        "greedy_identical": all(r["greedy_identical"] for r in runs),
        "costs_ms": {
            "verify": {n: round(s * 1000, 2) for n, s in costs["verify_s"].items()},
            "draft_token": round(costs["draft_token_s"] * 1000, 2),
        },
        "setup": {
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "target": target.model_id, "draft": draft.model_id,
        },
        "runs": runs,
    }
