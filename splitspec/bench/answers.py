"""The drafter trainer's answer paths side by side: the engine's runner with continuous batching
(``answers.continuous_answers``) against transformers' batched ``generate``, on the same units of a data folder,
in one process (one torch thread), greedy and sampled units both.

    python -m splitspec.bench.answers --target ~/.cache/splitspec/models/SmolLM2-135M-Instruct \
        --data data/drafter/default --units 3,0 --json docs/bench/drafter-train/answers.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from services.training import pipeline
from splitspec.drafter import load_target


def run(target: str, data: Path, units: list[int]) -> dict:
    model, tokenizer = load_target(target, threads=1)
    runner = pipeline.answer_runner(model)
    if runner is None:
        raise SystemExit(f"{target}: the compact forward does not run this target here (no continuous batching)")
    pool = [tuple(x) for x in json.loads((data / "prompts.json").read_text())]
    job = pipeline.TrainJob(target=target)
    rows = []
    for n in units:
        for path, answerer in (("continuous", runner), ("generate", None)):
            start = time.perf_counter()
            answered = pipeline.answer_unit(model, tokenizer, job, pool, n, answerer)
            seconds = time.perf_counter() - start
            tokens = pipeline.answer_tokens(answered)
            rows.append({"unit": n, "temperature": answered[0]["temperature"], "path": path, "tokens": tokens,
                         "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1)})
            print(rows[-1], flush=True)
    ratios = {}
    for n in units:
        by = {r["path"]: r["tok_s"] for r in rows if r["unit"] == n}
        ratios[f"unit {n}"] = round(by["continuous"] / by["generate"], 2)
    print("continuous / generate, answer tokens/s:", ratios)
    return {"target": Path(target).name, "threads": 1, "rows": rows, "continuous_over_generate": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", type=Path, required=True, help="a data folder (its prompts.json)")
    parser.add_argument("--units", default="3,0", help="unit numbers, comma separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = run(args.target, args.data, [int(n) for n in args.units.split(",")])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
