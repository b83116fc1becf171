"""Two builds of the compiled attention (``services/csrc``) timed side by side, and checked bit-identical.

    .venv/bin/python scripts/attention_ab.py EARLIER_CSRC_DIR services/csrc

30 layers of ``decode_attention`` (the default target's heads: 9 query, 3 KV, 64 wide) over sessions x rows at a
cached length, ABBA order, median of 6; the two outputs must be the same bits.
"""

import sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, "/work/main")
from torch.utils.cpp_extension import load
from services.kernels import build_flags
mods = {}
for tag, d in (("orig", sys.argv[1]), ("new", sys.argv[2])):
    mods[tag] = load(name=f"kb_attn_{tag}_{abs(hash(open(d + '/decode_attention.cpp').read())) % 100000}", sources=[f"{d}/bindings.cpp", f"{d}/skinny_gemm.cpp", f"{d}/decode_attention.cpp"], extra_cflags=build_flags())
gen = torch.Generator().manual_seed(0)
h, hkv, d, layers = 9, 3, 64, 30
def case(sessions, rows, start, tree=False):
    N = sessions * rows
    q = torch.randn(h, N, d, generator=gen); k = torch.randn(hkv, N, d, generator=gen); v = torch.randn(hkv, N, d, generator=gen)
    caches = [torch.randn(layers, 2, hkv, start + rows + 8, d, generator=gen) for _ in range(sessions)]
    offsets = [i * rows for i in range(sessions)]
    parents = [[-1, 0, 0, 1, 2][:rows] for _ in range(sessions)] if tree else []
    return q, k, v, caches, offsets, [rows] * sessions, [start] * sessions, parents
for sessions, rows, start, tree in ((1, 1, 100, False), (8, 1, 100, False), (8, 1, 400, False), (1, 5, 100, True), (32, 1, 100, False)):
    q, k, v, caches, offsets, sizes, starts, parents = case(sessions, rows, start, tree)
    outs, times = {}, {t: [] for t in mods}
    for rep in range(6):
        for tag in (list(mods) if rep % 2 == 0 else list(mods)[::-1]):
            out = torch.empty(sessions * rows, h * d)
            cs = [c.clone() for c in caches]
            t0 = time.perf_counter()
            for layer in range(layers):
                mods[tag].decode_attention(out, q, k, v, cs, offsets, sizes, starts, layer, 0.125, parents)
            times[tag].append((time.perf_counter() - t0) * 1e3)
            outs[tag] = out
    assert torch.equal(outs["orig"], outs["new"])
    print(f"{sessions}x{rows} start {start} tree {tree}: orig {sorted(times['orig'])[2]:.2f} ms new {sorted(times['new'])[2]:.2f} ms (30 layers), identical")
