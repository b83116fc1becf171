"""Optional compiled kernels, built on first use with the machine's C++ compiler.

``skinny_gemm()`` returns a function computing ``x @ w.T`` for 1..8 rows of
x (a verify chunk) that reads each weight row once (``csrc/skinny_gemm.cpp``),
or None where it cannot be built (no AVX2/FMA, no compiler or ninja, or
``SPLITSPEC_NO_KERNELS`` set); callers then use BLAS. The first build takes
about a minute and is cached by torch under ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SKINNY_MAX_ROWS = 8
_SOURCE = Path(__file__).parent / "csrc" / "skinny_gemm.cpp"


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build():
    if os.environ.get("SPLITSPEC_NO_KERNELS") or not _cpu_has_avx2_fma():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="splitspec_skinny_gemm",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma"],
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
