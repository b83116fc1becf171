"""Two builds of the compiled attention (a ``services/csrc``-like folder each), timed side by side and compared.

    .venv/bin/python scripts/attention_ab.py EARLIER_CSRC_DIR services/csrc

30 layers of ``decode_attention`` (the default target's heads: 9 query, 3 KV, 64 wide) over sessions x rows at a
cached length, the two builds in ABBA order, median of 6 (ms); the two outputs must be the same bits. An earlier
commit's folder: ``python -c "from compare_kernels import _earlier_sources; print(_earlier_sources('COMMIT'))"`` in
scripts/.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CASES = [(1, 1, 100, False), (8, 1, 100, False), (8, 1, 400, False), (1, 5, 100, True), (32, 1, 100, False)]


def _case(gen, sessions: int, rows: int, start: int, tree: bool) -> tuple:
    n = sessions * rows
    q = torch.randn(HEADS, n, HEAD_DIM, generator=gen)  # [h, N, d]
    k, v = (torch.randn(KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))  # [h_kv, N, d]
    caches = [torch.randn(LAYERS, 2, KV_HEADS, start + rows + 8, HEAD_DIM, generator=gen) for _ in range(sessions)]
    parents = [[-1, 0, 0, 1, 2][:rows] for _ in range(sessions)] if tree else []
    return q, k, v, caches, [i * rows for i in range(sessions)], [rows] * sessions, [start] * sessions, parents


def main() -> None:
    torch.set_num_threads(1)
    from compare_kernels import _build

    builds = {name: _build(Path(folder), f"splitspec_attention_ab_{name}")
              for name, folder in (("earlier", sys.argv[1]), ("current", sys.argv[2]))}
    gen = torch.Generator().manual_seed(0)
    for sessions, rows, start, tree in CASES:
        q, k, v, caches, offsets, sizes, starts, parents = _case(gen, sessions, rows, start, tree)
        outs, times = {}, {name: [] for name in builds}
        for rep in range(6):
            for name in list(builds) if rep % 2 == 0 else list(builds)[::-1]:
                out, fresh = torch.empty(sessions * rows, HEADS * HEAD_DIM), [cache.clone() for cache in caches]
                begin = time.perf_counter()
                for layer in range(LAYERS):
                    builds[name].decode_attention(out, q, k, v, fresh, offsets, sizes, starts, layer, 0.125, parents)
                times[name].append((time.perf_counter() - begin) * 1e3)
                outs[name] = out
        assert torch.equal(outs["earlier"], outs["current"]), "the two builds' outputs differ"
        earlier, current = (sorted(times[name])[2] for name in ("earlier", "current"))
        shape = f"{sessions:>2} x {rows} rows at {start} cached{' (tree)' if tree else ''}"
        print(f"{shape}: {earlier:.2f} -> {current:.2f} ms (the same bits)")


if __name__ == "__main__":
    main()
