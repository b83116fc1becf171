"""What batching buys each engine, in one process: B sessions' calls one by one vs in one batched pass.

    splitspec bench batching --sessions 1,4,8,16 --json batching.json

Default pair, greedy, held-out prompts, side by side in one run (the calls
alternate, so machine noise hits both alike): a verify step of every session
(one draft token each: 2 rows), an EAGLE proposal (k = 1 and k = 3) and a
draft-model proposal (k = 1). Prints the milliseconds of a round and the
ratio one-by-one / batched; the answers are the same either way (tested in
tests/services/test_batched_*.py).
"""

from __future__ import annotations

import time

import torch

DEFAULT_SESSIONS = (1, 4, 8, 16)


def run(sessions=DEFAULT_SESSIONS, *, repeats: int = 8) -> dict:
    from services import eagle_draft
    from services.draft import DraftEngine, ProposeCall
    from services.loading import describe, load_causal_lm
    from services.models import default_pair
    from services.models.prompts import held_out_prompts
    from services.prefill import PrefillEngine
    from services.sampling import SamplingParams
    from services.text import encode_prompt
    from services.verify import VerifyCall, VerifyEngine

    target_dir, drafter_dir = default_pair.prepare()
    target, drafter = load_causal_lm(target_dir), load_causal_lm(drafter_dir)
    tokenizer = describe(target_dir).tokenizer
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    draft = DraftEngine(drafter, eagle_head=eagle_draft.load(eagle_draft.find(drafter_dir), target))
    greedy, hidden = SamplingParams(), target.config.hidden_size
    prompts = [encode_prompt(tokenizer, "", [("user", p)]) for p in held_out_prompts()]
    n_max = max(sessions)
    for i in range(n_max):  # one verify session and two draft sessions (EAGLE, draft model) per prompt
        result = prefill.prefill(prompts[i % len(prompts)], greedy, features=True)
        verify.open(f"v{i}", result.payload, result.first_token, greedy)
        draft.start(f"e{i}", prompts[i % len(prompts)], greedy, "eagle", result.features)
        draft.start(f"m{i}", prompts[i % len(prompts)], greedy, "model")
        for sid in (f"e{i}", f"m{i}"):
            draft.propose(sid, 1, accepts=[(0, result.first_token, None)])

    def verdict(step: int) -> tuple:  # what a session's drafter accepts before its next proposal
        return (0, 100 + step, torch.randn(1, hidden).bfloat16())

    kinds = {
        "verify (1 draft token)": (
            lambda sid, step: verify.verify(sid, [100 + step]),
            lambda sids, step: verify.verify_batch([VerifyCall(sid, [100 + step]) for sid in sids]), "v"),
        "eagle propose k=1": (
            lambda sid, step: draft.propose(sid, 1, accepts=[verdict(step)]),
            lambda sids, step: draft.propose_batch([ProposeCall(sid, 1, accepts=[verdict(step)]) for sid in sids]), "e"),
        "eagle propose k=3": (
            lambda sid, step: draft.propose(sid, 3, accepts=[verdict(step)]),
            lambda sids, step: draft.propose_batch([ProposeCall(sid, 3, accepts=[verdict(step)]) for sid in sids]), "e"),
        "model propose k=1": (
            lambda sid, step: draft.propose(sid, 1, accepts=[verdict(step)[:2] + (None,)]),
            lambda sids, step: draft.propose_batch([ProposeCall(sid, 1, accepts=[verdict(step)[:2] + (None,)]) for sid in sids]),
            "m"),
    }
    report = {"repeats": repeats, "threads": torch.get_num_threads(), "rows": []}
    for name, (alone, batched, prefix) in kinds.items():
        for n in sessions:
            sids = [f"{prefix}{i}" for i in range(n)]
            alone_s = batched_s = 0.0
            for step in range(repeats + 1):  # the first round warms up
                start = time.perf_counter()
                for sid in sids:
                    alone(sid, step)
                middle = time.perf_counter()
                for outcome in batched(sids, step):
                    if isinstance(outcome, Exception):
                        raise outcome
                end = time.perf_counter()
                if step:
                    alone_s, batched_s = alone_s + middle - start, batched_s + end - middle
            report["rows"].append({"call": name, "sessions": n, "one_by_one_ms": round(1000 * alone_s / repeats, 2),
                                   "batched_ms": round(1000 * batched_s / repeats, 2),
                                   "speedup": round(alone_s / batched_s, 2)})
    return report


def print_report(report: dict) -> None:
    print(f"one round of calls, {report['threads']} torch thread(s), mean of {report['repeats']} rounds:")
    for r in report["rows"]:
        print(f"  {r['call']:<24} {r['sessions']:>3} sessions: one by one {r['one_by_one_ms']:8.1f} ms, "
              f"batched {r['batched_ms']:8.1f} ms ({r['speedup']:.2f}x)")
