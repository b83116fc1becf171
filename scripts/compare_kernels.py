"""Verify passes of the default target with the current kernels vs those of an earlier commit, side by side.

    .venv/bin/python scripts/compare_kernels.py 8a7600d   # --sessions 1,4,8,16 --rows 1,2 --repeats 8

Builds that commit's ``services/csrc/skinny_gemm.cpp`` as a second extension and alternates, pass by pass, the
current forward (compiled attention, current matmul kernel) with the earlier one (SDPA per sequence, earlier
matmul kernel), so machine noise hits both alike. One torch thread, greedy, random prompts of 150-300 tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def _earlier_kernel(commit: str):
    from torch.utils.cpp_extension import load

    source = subprocess.run(["git", "show", f"{commit}:services/csrc/skinny_gemm.cpp"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "skinny_gemm_earlier.cpp"
    path.write_text(source)
    from services.kernels import build_flags

    return load(name=f"splitspec_skinny_gemm_{commit}", sources=[str(path)], extra_cflags=build_flags()).skinny_gemm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("commit")
    parser.add_argument("--sessions", default="1,4,8,16")
    parser.add_argument("--rows", default="1,2", help="rows per session (1 + draft tokens)")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from services import kernels
    from services.loading import load_causal_lm
    from services.models import default_pair
    from services.runner import make_runner

    runner = make_runner(load_causal_lm(default_pair.prepare()[0]))
    current = (kernels.skinny_gemm(), kernels.decode_attention())
    earlier = (_earlier_kernel(args.commit), None)
    gen = torch.Generator().manual_seed(0)
    print(f"ms per verify pass, current vs {args.commit}, mean of {args.repeats} alternating passes:")
    for sessions in map(int, args.sessions.split(",")):
        caches = []
        for i in range(sessions):
            cache = runner.new_cache()
            runner.forward(torch.randint(5, 1000, (150 + 150 * i // max(sessions - 1, 1),), generator=gen), cache)
            caches.append(cache)
        for rows in map(int, args.rows.split(",")):
            totals = {"current": 0.0, "earlier": 0.0}
            for step in range(args.repeats + 1):  # the first round warms up
                for name, (gemm, attend) in (("current", current), ("earlier", earlier)):
                    kernels.skinny_gemm, kernels.decode_attention = (lambda g=gemm: g), (lambda a=attend: a)
                    chunks = [(torch.randint(5, 1000, (rows,), generator=gen), cache) for cache in caches]
                    start = time.perf_counter()
                    runner.forward_batch(chunks)
                    if step:
                        totals[name] += time.perf_counter() - start
                    for cache in caches:
                        cache.crop(cache.seq_len - rows)
            now, before = (1000 * totals[k] / args.repeats for k in ("current", "earlier"))
            print(f"  {sessions:>2} sessions x {rows} rows: {before:7.1f} -> {now:7.1f} ms ({before / now:.2f}x)")


if __name__ == "__main__":
    main()
