"""In-process A/B of the EAGLE head's kept ids (``models.draft_vocab_size``), side by side in one run.

Each round decodes 8 held-out prompts x 64 tokens, greedy, with the target alone and then with EAGLE at pinned k
(chained steps, trees of width 3, as the verify replica runs them) for every size; prints tok/s, the ratio to the
round's own target alone and the mean accepted length, and checks every output against the target alone.

Usage: .venv/bin/python scripts/eagle_vocab_ab.py 16384,8192,4096 2 3   # sizes, k, rounds
"""

from __future__ import annotations

import sys
import time

import torch

from deployments.config import AppConfig
from deployments.stages import load_target, model_dirs
from services import eagle_draft
from services.draft import DraftEngine
from services.loading import DTYPES, load_causal_lm
from services.loop import generate
from services.models.distill import chat_ids
from services.models.prompts import held_out_prompts
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.verify import VerifyEngine


def main() -> None:
    sizes = [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "16384,8192").split(",")]
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.set_num_threads(1)  # as a replica runs
    config = AppConfig()
    target = load_target(config)
    _, draft_dir = model_dirs(config)
    head = eagle_draft.load(eagle_draft.find(draft_dir), target)
    draft_model = load_causal_lm(draft_dir, dtype=config.models.dtype)
    engines = {n: DraftEngine(draft_model, eagle_head=head, draft_vocab_size=n,
                              weight_storage=DTYPES[config.models.draft_weights]) for n in sizes}
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    prompts = [chat_ids(target.tokenizer, p) for p in held_out_prompts()[:8]]

    def run(draft: DraftEngine | None) -> tuple[float, list[list[int]], float]:
        tokens, steps, seconds = [], 0, 0.0
        for ids in prompts:
            start = time.perf_counter()
            result = generate(prefill, draft, verify, ids, max_new_tokens=64, num_draft_tokens=k if draft else 0,
                              params=SamplingParams(), drafter="eagle", tree_width=3, chained=True)
            seconds += time.perf_counter() - start
            tokens.append(result.token_ids)
            steps += result.stats.steps
        n = sum(map(len, tokens))
        return n / seconds, tokens, n / steps

    run(engines[sizes[0]])  # warm-up
    for r in range(rounds):
        off, reference, _ = run(None)
        line = [f"round {r}: off {off:.2f} tok/s"]
        for n in sizes:
            tok_s, tokens, per_step = run(engines[n])
            assert tokens == reference, f"N={n}: not the target's greedy output"
            line.append(f"N={n} ({len(engines[n].eagle_head.kept_ids)} ids) {tok_s:.2f} ({tok_s / off:.3f}x, "
                        f"{per_step:.3f} tokens/step)")
        print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
