"""How much the target's answers copy their context: per Spec-Bench category, the share of answer positions where
prompt lookup's next token (``find_candidates(context, 1)``, the context being the prompt and the answer so far) is
the target's greedy token. A ceiling on what lookup drafting alone can accept there.

    python -m splitspec.bench.copying --prompts 4 --max-new-tokens 64 --json docs/bench/specbench/copying.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from services.models import default_pair, specbench
from services.prompt_lookup import find_candidates
from services.text import chat_ids
from splitspec.drafter import load_target


def run(target: str, prompts: int, max_new_tokens: int) -> dict:
    model, tokenizer = load_target(target, threads=1)
    questions = specbench.interleaved()
    out = {}
    for category in dict.fromkeys(q.category for q in questions):
        hits = positions = 0
        for q in [q for q in questions if q.category == category][:prompts]:
            ids = chat_ids(tokenizer, q.first_turn)
            answer = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
            for t, token in enumerate(answer):
                guess = find_candidates(ids + answer[:t], 1)
                hits += bool(guess) and guess[0] == token
            positions += len(answer)
        out[category] = {"positions": positions, "lookup_right": round(hits / positions, 3)}
        print(f"{category}: lookup's next token is the target's at {hits}/{positions} = {hits / positions:.2f}", flush=True)
    return {"prompts_per_category": prompts, "max_new_tokens": max_new_tokens, "categories": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(default_pair.target_dir()))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = run(args.target, args.prompts, args.max_new_tokens)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
