"""The matmul kernel of an earlier commit vs the current one, over the default target's matmuls, process by process.

    .venv/bin/python scripts/gemm_ab.py 7e7c3cb   # --rows 1,2,4,5,6,7,8,10,12,16 --rounds 3 --dtype float32|bfloat16
    .venv/bin/python scripts/gemm_ab.py 7e7c3cb --passes 1x1,1x5,2x5,4x2,8x1,16x1   # whole verify passes
    .venv/bin/python scripts/gemm_ab.py 5c5064a --passes 8x1,32x1 --gil   # beside a thread that wants the GIL
    .venv/bin/python scripts/gemm_ab.py 8896060 --passes 1x1,8x1,32x1 --greedy   # greedy sessions' passes

Each side runs in a fresh process of its own (that commit's ``services/csrc`` built as a second extension), the two
alternating round by round: timed in one process, the two kernels' weight copies sit in different memory, and
whichever runs second after the other is measurably faster, so side by side in one process misleads by 10% and
more here. A process times every matmul of the default target (30 layers' QKV, output, gate-up and down
projections, then the LM head; bfloat16: a 4-layer drafter and an 8192-row head) on random weights, median of 7,
for each row count; with ``--passes`` (sessions x rows each), verify passes of the default target instead (the
engine's forward over every session's chunk, prompts of 60-210 tokens), median of 8. One torch thread. ``--gil``:
a Python thread beside the passes runs bytecode for a while every half millisecond, as a replica's event loop does
while it streams the other sessions' tokens (a build without ``decoder_layers`` runs the Python layer loop).
``--greedy``: the passes' sessions are greedy (``forward_batch(greedy=...)``: their argmax ids, through
``kernels.greedy_head`` where the build has it, else their logits' argmax).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): the default target's fused matmuls


def _time_one(sources: str, tag: str, rows: list[int], bf16: bool, passes: list[str], gil: bool = False,
              greedy: bool = False) -> dict:
    from compare_kernels import _build

    from services.kernels import panels

    module = _build(Path(sources), f"splitspec_gemm_ab_{tag}")
    if passes:
        if gil:
            threading.Thread(target=_wants_the_gil, daemon=True).start()
        return _time_passes(module, passes, greedy)
    try:
        width = module.panel_width(bf16)
    except TypeError:  # (kernels with one panel width for every dtype)
        width = module.panel_width()
    shapes = LAYER * 4 + [(8192, 576)] if bf16 else LAYER * 30 + [(49152, 576)]
    torch.manual_seed(0)
    weights = []
    for out, inputs in shapes:
        packed = panels(torch.randn(out, inputs) * 0.02, width)
        weights.append((packed.bfloat16() if bf16 else packed, out, inputs))
    medians = {}
    for m in rows:
        x = {inputs: torch.randn(m, inputs) for inputs in (576, 1536)}
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for packed, out, inputs in weights:
                module.skinny_gemm(x[inputs], packed, out)
            times.append((time.perf_counter() - start) * 1e3)
        medians[m] = sorted(times)[3]
    return medians


def _wants_the_gil() -> None:
    total = 0
    while True:
        for i in range(2000):  # bytecode (about 0.1 ms): the GIL is held until the interpreter hands it over
            total += i
        time.sleep(0.0005)


class _OneWidth:
    """An earlier kernel module whose ``panel_width()`` took no dtype, as the engine now calls it."""

    def __init__(self, module):
        self._module = module

    def panel_width(self, bfloat16: bool = False) -> int:
        return self._module.panel_width()

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _time_passes(module, passes: list[str], greedy: bool = False) -> dict:
    """Median ms of the default target's verify passes with ``module``'s kernels."""
    from services import kernels

    try:
        module.panel_width(False)
    except TypeError:  # (kernels with one panel width for every dtype)
        module = _OneWidth(module)
    kernels._module = module  # (the engine packs its weights with this module's panel width)
    from services.loading import load_causal_lm
    from services.models import default_pair
    from services.runner import make_runner

    runner = make_runner(load_causal_lm(default_pair.prepare()[0]))
    gen = torch.Generator().manual_seed(0)
    caches = []
    for i in range(16):
        caches.append(runner.new_cache())
        runner.forward(torch.randint(5, 1000, (60 + 10 * i,), generator=gen), caches[-1])
    medians = {}
    for shape in passes:
        sessions, rows = map(int, shape.split("x"))
        times = []
        for _ in range(9):  # (the first warms up)
            chunks = [(torch.randint(5, 1000, (rows,), generator=gen), caches[j % 16]) for j in range(sessions)]
            start = time.perf_counter()
            runner.forward_batch(chunks, greedy=[True] * sessions if greedy else None)
            times.append((time.perf_counter() - start) * 1e3)
            for _, cache in chunks:
                cache.crop(cache.seq_len - rows)
        medians[shape] = sorted(times[1:])[4]
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("commit", nargs="?")
    parser.add_argument("--rows", default="1,2,4,5,6,7,8,10,12,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--passes", default="", help="sessions x rows of verify passes to time, e.g. 1x1,8x1")
    parser.add_argument("--gil", action="store_true", help="time the passes beside a thread that wants the GIL")
    parser.add_argument("--greedy", action="store_true", help="the passes' sessions are greedy (argmax ids)")
    parser.add_argument("--one", nargs=2, metavar=("SOURCES", "TAG"), help=argparse.SUPPRESS)  # a side's process
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    if args.one:
        passes = [p for p in args.passes.split(",") if p]
        print(json.dumps(_time_one(*args.one, rows, args.dtype == "bfloat16", passes, args.gil,
                                    args.greedy)))
        return
    from compare_kernels import _earlier_sources

    current = Path(__file__).parent.parent / "services/csrc"
    sides = {"earlier": str(_earlier_sources(args.commit)), "current": str(current)}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, sources in sides.items():
            command = [sys.executable, __file__, "--one", sources, f"{side}_{args.commit}", "--rows", args.rows,
                       "--dtype", args.dtype, "--passes", args.passes] + (["--gil"] if args.gil else []) \
                + (["--greedy"] if args.greedy else [])
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    what = "verify pass (sessions x rows)" if args.passes else f"pass over the matmuls ({args.dtype})"
    what += ", beside a thread that wants the GIL" if args.gil else ""
    what += ", greedy sessions" if args.greedy else ""
    print(f"ms per {what}, {args.commit} -> current, each round a process per side:")
    for m in (args.passes.split(",") if args.passes else map(str, rows)):
        before, now = ([run[m] for run in runs[side]] for side in ("earlier", "current"))
        print(f"  {m:>5}: {' '.join(f'{t:5.1f}' for t in before)} -> {' '.join(f'{t:5.1f}' for t in now)}"
              f"  ({sum(before) / sum(now):.2f}x)")


if __name__ == "__main__":
    main()
