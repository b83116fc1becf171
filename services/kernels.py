"""Optional compiled kernels, built on first use with the machine's C++ compiler.

* ``skinny_gemm()`` returns a function computing ``x @ w.T`` for a few rows
  of x (a decode step, a verify chunk, or several sessions' chunks batched)
  that streams the weight once, packed by ``pack_weight`` into panels
  (``csrc/skinny_gemm.cpp``);
* ``decoder_layers()`` returns a function running every decoder layer over
  short chunks in one call without the GIL (``csrc/decoder_layers.cpp``);
* ``greedy_head()`` returns a function giving each row's argmax of
  ``x @ w.T`` — that of ``skinny_gemm``'s logits, bit for bit — through a
  bfloat16 screen with an error bound and the exact logits of the few
  candidates it leaves (``csrc/greedy_head.cpp``; AVX512_BF16 only);
* ``decode_attention()`` returns a function that appends several sequences'
  short chunks to their KV caches and computes their attention in one call
  (``csrc/decode_attention.cpp``), where SDPA would be one call per sequence
  and layer.

They use AVX-512 where the CPU has it, else AVX2, and are None where the
module cannot be built (no AVX2/FMA, no compiler or ninja, or
``SPLITSPEC_NO_KERNELS`` set); callers then use BLAS and SDPA. The first
build takes about a minute and is cached by torch under
``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SKINNY_MAX_ROWS = 32  # beyond this many rows a BLAS GEMM is compute-efficient enough
DECODE_ATTENTION_MAX_ROWS = 32  # longer chunks (prompts) take SDPA, whose blocked kernel suits them
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "skinny_gemm.cpp", "decode_attention.cpp",
                                                               "decoder_layers.cpp", "greedy_head.cpp")]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_flags() -> list[str]:
    """The compiler flags of the kernels on this CPU (AVX-512 where it has it)."""
    flags = _cpu_flags()
    return (["-O3", "-mavx2", "-mfma"] + (["-mavx512f"] if "avx512f" in flags else [])
            + (["-mavx512bf16", "-mavx512bw"] if {"avx512f", "avx512_bf16", "avx512bw"} <= flags else []))


def _build():
    if os.environ.get("SPLITSPEC_NO_KERNELS") or not {"avx2", "fma"} <= _cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="splitspec_kernels",
            sources=[str(source) for source in _SOURCES],
            extra_cflags=build_flags(),
            verbose=False,
        )
        return module
    except Exception as exc:  # no compiler / ninja: fall back to BLAS and SDPA, loudly
        logger.warning("compiled kernels unavailable (%s); using BLAS and SDPA", exc)
        return None


_UNBUILT = object()
_module = _UNBUILT


def _kernels():
    global _module
    if _module is _UNBUILT:
        _module = _build()
    return _module


def row_groups(sizes: list[int], limit: int = SKINNY_MAX_ROWS) -> list[list[int]]:
    """The chunks of a pass (their row counts ``sizes``) in groups of consecutive chunks of at most ``limit`` rows
    in all, a longer chunk alone: a pass runs group by group, so every short chunk's rows go through the
    row-independent kernels (``skinny_gemm``) however many rows the pass has, and its result is the same bits as
    alone; beyond ``limit`` rows a BLAS GEMM would compute them, its rounding depending on the other rows."""
    groups, current, rows = [], [], 0
    for i, n in enumerate(sizes):
        if current and rows + n > limit:
            groups.append(current)
            current, rows = [], 0
        current.append(i)
        rows += n
    return groups + ([current] if current else [])


def skinny_gemm():
    """``(x [m, in], pack_weight(w), out) -> x @ w.T [m, out]``, built on first call (None if unavailable)."""
    module = _kernels()
    return None if module is None else module.skinny_gemm


def pack_weight(weight: torch.Tensor, storage: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` [out, in] in ``skinny_gemm``'s layout, [ceil(out / width), in, width]: panels of ``width``
    outputs (the last zero-padded), each input by input, as ``storage`` (float32, or bfloat16: half the bytes to
    stream; the values are rounded to it). The panel width is the kernel's for that type (32 for float32, 64 for
    bfloat16: csrc/skinny_gemm.cpp)."""
    if storage not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the kernel takes float32 or bfloat16 weights, not {storage}")
    return panels(weight, _kernels().panel_width(storage == torch.bfloat16)).to(storage)


def panels(weight: torch.Tensor, width: int) -> torch.Tensor:  # [out, in] -> [ceil(out / width), in, width]
    """The panel layout for any ``width`` (``pack_weight`` takes the built kernel's; benchmarks, an earlier one's)."""
    out, inputs = weight.shape
    count = -(-out // width)
    padded = torch.zeros(count * width, inputs, dtype=weight.dtype)
    padded[:out] = weight
    return padded.view(count, width, inputs).transpose(1, 2).contiguous()


def decode_attention():
    """``(out, q, k, v, caches, offsets, sizes, starts, layer, scale, parents=[]) -> None``, or None if unavailable.

    ``q [h, N, d]``, ``k`` / ``v`` ``[h_kv, N, d]`` (roped, last dimension contiguous) hold the rows of several
    chunks; chunk c's rows ``offsets[c] .. + sizes[c]`` go to positions ``starts[c] ..`` of ``caches[c]``
    (``[layers, 2, h_kv, capacity, d]``, float32) at ``layer``, and attend causally to it; ``out [N, h * d]`` gets
    their rows. ``parents[c]``, if given and not empty, makes chunk c a draft tree (services.tree): each row's
    parent row (-1 for the first), and a row attends to the cache, its ancestors and itself — bit for bit as the
    same tokens decoded as a sequence would.
    """
    module = _kernels()
    return None if module is None else module.decode_attention


def decoder_layers():
    """``(x, layers, cos, sin, eps, heads, kv_heads, head_dim, intermediate, caches, offsets, sizes, starts, scale,
    parents) -> x`` after every layer, or None if unavailable: ``FastLlamaRunner._layers``' torch calls over short
    chunks (each projection through ``skinny_gemm``, attention through ``decode_attention``) made in C++, the same
    bits. ``layers``: per layer ``[ln1, qkv, o, ln2, gate_up, down]``, the projections packed (``pack_weight``)."""
    return getattr(_kernels(), "decoder_layers", None)  # (None too in an earlier build without it: benchmarks)


NO_GREEDY_HEAD_ENV = "SPLITSPEC_NO_GREEDY_HEAD"  # set: greedy_head() is None, as where it is not built


def greedy_head():
    """``(x [m, in], pack_screen(w), pack_weight(w), row_norms(w), out) -> (ids [m], candidates [m])``: per row the
    argmax of ``x @ w.T`` as ``skinny_gemm``'s float32 logits give it, through a bfloat16 screen and the exact
    logits of its few candidates (``csrc/greedy_head.cpp``; -1 for a row with a value that is not finite), or None
    where it is not built (no AVX512_BF16), the kernels are unavailable, or ``SPLITSPEC_NO_GREEDY_HEAD`` is set."""
    if os.environ.get(NO_GREEDY_HEAD_ENV):  # (tests: the path of a CPU without AVX512_BF16, on any CPU)
        return None
    module = _kernels()
    built = module is not None and getattr(module, "greedy_head_built", lambda: False)()
    return module.greedy_head if built else None


def pack_screen(weight: torch.Tensor) -> torch.Tensor:  # [out, in] float32 -> [ceil(out / 32), ceil(in / 2), 32] int32
    """``weight`` rounded to bfloat16 (nearest even), each output's inputs in pairs (2i low, 2i + 1 high: the
    operand of AVX512_BF16's dot product), in panels of 32 outputs (``greedy_head``'s screen)."""
    out, inputs = weight.shape
    padded = torch.zeros(out, inputs + inputs % 2, dtype=torch.bfloat16)
    padded[:, :inputs] = weight
    pairs = padded.view(torch.int16).view(out, -1, 2).contiguous().view(torch.int32).view(out, -1)  # [out, in / 2]
    return panels(pairs, 32)


def row_norms(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out] float32
    """Each row's Euclidean norm, computed in float64 and rounded up to float32 (``greedy_head``'s error bound)."""
    norms = weight.double().norm(dim=1)
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
