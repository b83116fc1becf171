"""Plain transformers' forward vs the batch-invariant one as the verifier, side by side, on the default pair.

For each verifier: is speculative greedy output (draft model, k = 2 and 4) token-identical to speculation off,
and how long the runs take (3 prompts x 64 tokens x (off, k=2, k=4)). On the CPU in bfloat16 by default, where
the plain forward moves a token.

    .venv/bin/python scripts/batch_invariant_ab.py [--dtype bfloat16] [--kv-capacity 512] [--device cpu]
"""

import argparse
import time

from services.draft import DraftEngine
from services.loading import load_causal_lm
from services.loop import generate
from services.models import default_pair
from services.models.distill import chat_ids
from services.prefill import PrefillEngine
from services.runner import ModelRunner
from services.sampling import SamplingParams
from services.verify import VerifyEngine

PROMPTS = ("Explain what a hash map is.", "Write a short poem about the sea.", "List three uses of Python.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-capacity", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    target = load_causal_lm(default_pair.target_dir(), dtype=args.dtype, device=args.device)
    draft = load_causal_lm(default_pair.drafter_dir(), dtype=args.dtype, device=args.device)
    prompts = [chat_ids(target.tokenizer, text) for text in PROMPTS]
    prefill, drafts = PrefillEngine(target), DraftEngine(draft)
    for name in ("plain transformers' forward", "batch-invariant"):
        verify = VerifyEngine(target, fast=False, kv_capacity=args.kv_capacity)
        if name.startswith("plain"):
            verify.runner = ModelRunner(target)
        start, verdicts = time.perf_counter(), []
        for i, prompt in enumerate(prompts):
            alone = generate(prefill, None, verify, prompt, max_new_tokens=args.new_tokens, num_draft_tokens=1,
                             params=SamplingParams()).token_ids
            for k in (2, 4):
                spec = generate(prefill, drafts, verify, prompt, max_new_tokens=args.new_tokens, num_draft_tokens=k,
                                params=SamplingParams()).token_ids
                moved = next((j for j, (a, b) in enumerate(zip(spec, alone)) if a != b), None)
                verdicts.append(f"prompt {i} k={k}: " + ("identical" if moved is None else f"differs at token {moved}"))
        print(f"{name} ({type(verify.runner).__name__}, {args.dtype}, {args.device}): "
              f"{time.perf_counter() - start:.1f} s; " + "; ".join(verdicts), flush=True)


if __name__ == "__main__":
    main()
