"""Verify passes of the default target with the current kernels vs those of an earlier commit, side by side.

    .venv/bin/python scripts/compare_kernels.py 8a7600d   # --sessions 1,4,8,16 --rows 1,2 --repeats 8

Builds that commit's ``services/csrc`` kernels as a second extension and alternates, pass by pass, the current
forward (current matmul kernel and attention) with the earlier one (that commit's matmul kernel, and its compiled
attention where it had one, else SDPA per sequence), so machine noise hits both alike. One torch thread, greedy,
random prompts of 150-300 tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def _earlier_sources(commit: str) -> Path:
    """A folder with that commit's ``services/csrc`` files."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:services/csrc"], check=True,
                            capture_output=True, text=True).stdout.split()
    folder = Path(tempfile.mkdtemp())
    for name in listed:
        source = subprocess.run(["git", "show", f"{commit}:services/csrc/{name}"], check=True, capture_output=True,
                                text=True).stdout
        (folder / name).write_text(source)
    return folder


def _build(folder: Path, name: str):
    """The kernels in ``folder`` (a ``services/csrc``), built as an extension of their own named ``name`` (the
    matmul kernel alone before bindings.cpp existed)."""
    from torch.utils.cpp_extension import load

    from services.kernels import build_flags

    listed = [path.name for path in folder.iterdir()]
    sources = [n for n in listed if n.endswith(".cpp")] if "bindings.cpp" in listed else ["skinny_gemm.cpp"]
    return load(name=name, sources=[str(folder / n) for n in sources], extra_cflags=build_flags())


def _earlier_kernels(commit: str):
    """That commit's compiled kernels, as a second extension."""
    return _build(_earlier_sources(commit), f"splitspec_kernels_{commit}")


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

    from services.fast_llama import Linear

    runner = make_runner(load_causal_lm(default_pair.prepare()[0]))
    earlier_module = _earlier_kernels(args.commit)
    earlier_gemm = earlier_module.skinny_gemm
    earlier_attention = getattr(earlier_module, "decode_attention", None)

    def earlier_skinny(linear, x):  # that commit's kernel, on the weight in its layout (kept here once per weight)
        if not hasattr(linear, "_earlier_w"):
            weight = linear.weight_t.t().contiguous()  # [out, in]
            linear._earlier_w = kernels.panels(weight, earlier_module.panel_width()) if packs else weight
        return earlier_gemm(x, linear._earlier_w, linear.out_features) if packs else earlier_gemm(x, linear._earlier_w)

    packs = hasattr(earlier_module, "panel_width")  # (kernels before 2026-12-04 took w [out, in] as it is)

    attention = kernels.decode_attention()
    current = (Linear._skinny, lambda: attention)
    earlier = (earlier_skinny, lambda: earlier_attention)  # (None: SDPA per sequence)
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
                    Linear._skinny, kernels.decode_attention = gemm, attend
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
