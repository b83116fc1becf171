"""Optional compiled kernels, built on first use with the machine's C++ compiler.

``skinny_gemm()`` returns a function computing ``x @ w.T`` for a few rows of
x (a verify chunk, or several sessions' chunks batched) that reads each weight
row once (``csrc/skinny_gemm.cpp``; AVX-512 where the CPU has it, else AVX2),
or None where it cannot be built (no AVX2/FMA, no compiler or ninja, or
``SPLITSPEC_NO_KERNELS`` set); callers then use BLAS. The first build takes
about a minute and is cached by torch under ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SKINNY_MAX_ROWS = 32  # beyond this many rows a BLAS GEMM is compute-efficient enough
_SOURCE = Path(__file__).parent / "csrc" / "skinny_gemm.cpp"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build():
    flags = _cpu_flags()
    if os.environ.get("SPLITSPEC_NO_KERNELS") or not {"avx2", "fma"} <= flags:
        return None
    cflags = ["-O3", "-mavx2", "-mfma"] + (["-mavx512f"] if "avx512f" in flags else [])
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="splitspec_skinny_gemm",
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            verbose=False,
        )
        return module.skinny_gemm
    except Exception as exc:  # no compiler / ninja: fall back to BLAS, loudly
        logger.warning("skinny_gemm kernel unavailable (%s); using BLAS for verify chunks", exc)
        return None


_UNBUILT = object()
_skinny = _UNBUILT


def skinny_gemm():
    """The compiled kernel, built on first call (None if unavailable)."""
    global _skinny
    if _skinny is _UNBUILT:
        _skinny = _build()
    return _skinny
