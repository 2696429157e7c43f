"""Exact float conversions on raw bits with numpy, no torch: the 256 values of a one-byte
dtype, small stored tensors (scales) widened to float32, and float32 rounded to
nearest-even into bfloat16 or float16 bits, each bit for bit what torch's CPU kernels give
(``tests/tensors/test_float_bits.py`` compares every code and the edge cases).

NaN outputs are the one place where torch's kernels differ between CPUs: its AVX2 and
AVX-512 float32 -> bfloat16 casts write every NaN as ``0xFFFF``, its scalar one (a CPU
without AVX2, or ``ATEN_CPU_CAPABILITY=default``) as ``0x7FC0``. :data:`LIKE_TORCH` says
where these conversions are known to match torch; elsewhere callers that must equal
torch's bytes ask torch itself.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt


def _vectorized_x86() -> bool:
    """Whether torch's CPU kernels here are its AVX2 / AVX-512 ones: an x86-64 CPU with AVX2
    (Linux's ``/proc/cpuinfo`` says; unknown elsewhere: no) not told to use the scalar ones."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "default":
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


LIKE_TORCH = _vectorized_x86()
BF16_NAN = 0xFFFF  # every NaN, as torch's vectorized x86-64 cast writes it
F16_QUIET_NAN = 0x7E00  # float16's exponent of all ones and quiet bit
CODES = 256
ROUNDED = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}  # output dtype -> its bits


def widened(stored: str) -> npt.NDArray[np.float32]:
    """float32 [256]: each byte code of the one-byte dtype ``stored`` as float32 (exact; a
    float8 NaN keeps its sign and takes the payload torch's cast gives it)."""
    code = np.arange(CODES, dtype=np.uint32)
    if stored in ("int8", "uint8"):
        return code.astype(np.uint8).view(stored).astype(np.float32)
    if stored not in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"no byte codes for {stored}")
    mantissa_bits, bias = (3, 7) if stored == "float8_e4m3fn" else (2, 15)
    sign = np.where(code >> 7 == 1, -1.0, 1.0)
    exponent = (code >> mantissa_bits) & ((1 << (7 - mantissa_bits)) - 1)
    mantissa = (code & ((1 << mantissa_bits) - 1)).astype(np.float64)
    normal = (1 + mantissa / (1 << mantissa_bits)) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    values = (sign * np.where(exponent == 0, subnormal, normal)).astype(np.float32)
    bits = values.view(np.uint32)
    top = exponent == (1 << (7 - mantissa_bits)) - 1
    if stored == "float8_e4m3fn":  # e4m3fn: no inf, one NaN per sign (S.1111.111)
        nan = top & ((code & 7) == 7)
        bits[nan] = (code[nan] >> 7 << 31) | 0x7FF00000
    else:  # e5m2 (IEEE-like): inf, and NaNs whose two mantissa bits become the top of float32's
        inf = top & ((code & 3) == 0)
        bits[inf] = (code[inf] >> 7 << 31) | 0x7F800000
        nan = top & ((code & 3) != 0)
        bits[nan] = (code[nan] >> 7 << 31) | 0x7FC00000 | ((code[nan] & 3) << 21)
    return values


def as_float32(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """The stored tensor ``data`` (``dtype``: float32, bfloat16, float16 or float8_e8m0fnu) as
    float32 of ``shape``, exactly (an e8m0 code c is 2**(c - 127); 0xFF: NaN)."""
    if dtype == "float32":
        out = np.frombuffer(data, np.float32).copy()
    elif dtype == "float16":
        out = np.frombuffer(data, np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        out = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif dtype == "float8_e8m0fnu":
        code = np.frombuffer(data, np.uint8).astype(np.uint32)
        bits = np.where(code == 0, np.uint32(0x00400000), code << 23)
        out = np.where(code == 0xFF, np.uint32(0x7F800001), bits).astype(np.uint32).view(np.float32)
    else:
        raise ValueError(f"no float32 view of {dtype}")
    return out.reshape(shape)


def rounded(values: npt.NDArray[np.float32], dtype: str) -> np.ndarray:
    """The bits of float32 ``values`` cast to ``dtype`` (bfloat16, float16: round to nearest,
    ties to even, overflow to inf; float32: as they are), as unsigned ints (:data:`ROUNDED`)."""
    if dtype == "float32":
        return values.view(np.uint32)
    if dtype == "float16":  # numpy rounds to nearest even, overflowing to inf
        with np.errstate(over="ignore"):
            half = values.astype(np.float16).view(np.uint16)
        nan = np.isnan(values)
        if nan.any():  # as F16C writes a NaN: the sign, the top ten payload bits, quieted
            bits = values.view(np.uint32)[nan]
            half[nan] = ((bits >> 16) & 0x8000) | F16_QUIET_NAN | ((bits >> 13) & 0x3FF)
        return half
    if dtype != "bfloat16":
        raise ValueError(f"no rounding to {dtype}")
    bits = values.view(np.uint32)
    wide = bits >> 16  # in place from here: a table is a few MiB, its temporaries cost more than the arithmetic
    wide &= 1
    wide += 0x7FFF
    wide += bits  # wraps only for NaNs (0xFF8..), set below
    wide >>= 16
    out = wide.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = BF16_NAN
    return out
