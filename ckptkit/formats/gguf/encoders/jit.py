"""What the compiled (numba) search loops share: the ``njit`` options
(:mod:`ckptkit.tensors.compiled`) and ggml's ``nearest_int`` of one float32.

numba compiles a loop as ggml's scalar C runs it: float32 values stay float32 (operands are
cast with ``np.float32``: an int or a Python float would widen to float64), and without
``fastmath`` LLVM neither reorders sums nor contracts multiply-adds into FMA, so each
value is rounded as the C reference built with ``-ffp-contract=off`` rounds it. Functions
are cached on disk (``cache=True``: compiled once per machine) and run without the GIL, so
the encoders' thread pool spreads them over the cores. numba checks a cache against the
file of the function it compiled only: after changing this module, delete the encoders'
``__pycache__/*.nbi``/``*.nbc``."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ckptkit.tensors.compiled import kernel

__all__ = ["LANES", "MAGIC", "kernel", "level", "nearest_int"]

MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves the rounded integer in the mantissa

LANES = 256  # blocks searched side by side: their independent sums fill the vector registers


def _bits_of(typingctx: Any, v: Any) -> Any:
    """The bits of a float32 as an int32 (C's ``memcpy(&i, &f, 4)``)."""
    if v != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


_bits: Any = intrinsic(_bits_of)


@numba.njit(inline="always")
def nearest_int(v: Any) -> Any:
    """ggml's ``nearest_int``: the low 23 bits of ``v + 1.5 * 2**23``, less ``2**22`` (also for
    what is out of its documented range: infinities, NaN)."""
    return np.int32((_bits(v + MAGIC) & 0x007FFFFF) - 0x00400000)


@numba.njit(inline="always")
def level(v: Any, lo: Any, hi: Any) -> Any:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as a float32 (exact: ``nearest_int`` is within
    ``2**22``), so that the loops convert from int32 only (which vectorises)."""
    return min(max(np.float32(nearest_int(v)), lo), hi)
