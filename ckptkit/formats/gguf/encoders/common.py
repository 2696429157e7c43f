"""The float32 and integer steps of ggml's reference quantizers, as numpy array operations.

Each helper does over an array what one C expression of ``ggml-quants.c`` does to one value,
with the same result bit for bit: float32 arithmetic (no float64 in between), ggml's
``nearest_int`` (the add-a-magic-number rounding, also outside its documented range), C's
truncating float -> int conversion as x86-64 does it (out of range or NaN: ``INT_MIN``), and
float32 -> float16 rounding to nearest even. Sums are taken in the C loops' order (element 0
first), so the inputs of the vectorized encoders are laid out element-major: ``(n, blocks)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

F32 = np.ndarray  # float32 values (numpy's stubs widen float32 arithmetic to float64)
I32 = np.ndarray  # int32 values

MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves the rounded integer in the mantissa
GROUP_MAX_EPS = np.float32(1e-15)
ZERO = np.float32(0)


def f32(v: float) -> np.float32:
    return np.float32(v)


def nearest_int(v: F32) -> I32:
    """ggml's ``nearest_int``: the low 23 bits of ``v + 1.5 * 2**23``, less ``2**22``."""
    bits = (v + MAGIC).view(np.int32)
    out: I32 = (bits & 0x007FFFFF) - 0x00400000
    return out


def c_int(v: F32) -> I32:
    """C's ``(int)v`` on x86-64 (``cvttss2si``): truncation, ``INT_MIN`` when out of range or NaN."""
    inside = np.abs(v) < f32(2.0**31)  # False for NaN
    out: I32 = np.where(inside, v, f32(0)).astype(np.int32)
    out[~inside] = np.iinfo(np.int32).min
    return out


def low_byte(v: I32) -> I32:
    """An int stored into ``uint8_t``."""
    out: I32 = v & 0xFF
    return out


def as_int8(v: I32) -> I32:
    """An int stored into ``int8_t`` and read back."""
    out: I32 = ((v & 0xFF) ^ 0x80) - 0x80
    return out


def fp16(v: F32) -> npt.NDArray[np.float16]:
    """``GGML_FP32_TO_FP16``: round to nearest even (NaN stays NaN)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16)


def first_abs_max(x: F32) -> F32:
    """Per row of ``x``: the first element of largest magnitude, as ggml's loops find it
    (``if (amax < fabsf(v))`` from ``amax = max = 0``: NaNs passed over, +0 when every
    ``|x|`` is 0 or NaN)."""
    ax = np.abs(x)
    amax = np.fmax.reduce(ax, axis=1, keepdims=True)
    first = np.argmax(ax == amax, axis=1)[:, None]
    out: F32 = np.where(amax[:, 0] > 0, np.take_along_axis(x, first, axis=1)[:, 0], f32(0))
    return out


def first_extreme(x: F32, largest: bool) -> F32:
    """Per row of ``x``: its minimum (maximum), the first one where zeros of both signs tie,
    as ``if (v < min) min = v`` keeps the first."""
    m = (x.max if largest else x.min)(axis=1, keepdims=True)
    first = np.argmax(x == m, axis=1)[:, None]
    out: F32 = np.take_along_axis(x, first, axis=1)[:, 0]
    return out


def running_sum(terms: F32) -> F32:
    """``s = 0; for i: s += terms[i]`` over axis 0, in that order: numpy reduces a leading
    axis row by row into the output (its pairwise summation is for the innermost axis)."""
    out: F32 = np.add.reduce(terms, axis=0, initial=ZERO)
    return out


def safe_inverse(d: F32) -> F32:
    """``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(np.float32)
    return inv


def element_major(x: F32, block: int) -> F32:
    """Blocks of ``block`` float32 as ``(block, n)``: element ``i`` of every block in row ``i``."""
    return np.ascontiguousarray(x.reshape(-1, block).T)


def nibbles(low: I32, high: I32) -> I32:
    """Two 4-bit quants to a byte: ``low | high << 4`` (each masked to 4 bits)."""
    out: I32 = (low & 0x0F) | ((high & 0x0F) << 4)
    return out


def fifth_bits(q: I32) -> npt.NDArray[np.uint32]:
    """Q5_0 / Q5_1's ``qh``: bit 4 of quant ``j`` (of a row's 32) at bit ``j``."""
    bits = ((q & 0x10) >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    out: npt.NDArray[np.uint32] = np.bitwise_or.reduce(bits, axis=1)
    return out


def blocks_out(*fields: npt.NDArray[np.generic]) -> npt.NDArray[np.uint8]:
    """The block bytes ``(n, size)``: each field ``(n,)`` of a scalar type (stored little-endian)
    or ``(n, k)`` byte values, in order."""
    parts = []
    for f in fields:
        if f.ndim == 1:
            parts.append(np.ascontiguousarray(f).view(np.uint8).reshape(f.shape[0], -1))
        else:
            parts.append(f.astype(np.uint8))
    return np.concatenate(parts, axis=1)


def best_index(values: F32, v: F32) -> I32:
    """ggml's ``best_index_int8(n, values, v)`` for every element of ``v``: the index of the
    sorted integer ``values`` (within +-128) nearest ``v``, the upper one on a tie, the ends
    outside their range, the last for NaN, as its bisection leaves it.

    Between neighbours ``a < b`` it takes ``a`` when ``v - a < b - v``; near the midpoint both
    differences are exact in float32 (under 24 apart, and ``v`` is over 4 there), so that is
    ``2 v < a + b``: the index is the count of the (integer) ``a + b`` at most ``floor(2 v)``,
    looked up in a table."""
    lut = np.searchsorted(values[:-1] + values[1:], np.arange(-256, 257, dtype=np.float32), side="right")
    with np.errstate(invalid="ignore"):
        twice = np.fmin(np.maximum(np.floor(v * f32(2)), f32(-256)), f32(256))  # NaN -> 256
    out: I32 = lut[twice.astype(np.int32) + 256]
    return out


def lround(v: F32) -> I32:
    """C's ``(int)lroundf(v)``: halves away from zero; glibc's ``LONG_MIN`` for what does not
    fit (infinities, NaN) leaves 0 in an ``int``."""
    t = np.trunc(v)
    with np.errstate(invalid="ignore"):
        r = t + np.where(np.abs(v - t) >= f32(0.5), np.sign(v), f32(0))
        out: I32 = np.where(np.abs(r) < f32(2.0**31), r, f32(0)).astype(np.int32)
    return out


def trits(x: F32) -> tuple[npt.NDArray[np.float16], I32]:
    """What TQ1_0 and TQ2_0 share, for blocks ``x`` (n, 256): the float16 scale (the block's
    largest magnitude) and every value as ``lroundf(x / scale) + 1``, 0..2."""
    amax = np.fmax.reduce(np.abs(x), axis=1)
    with np.errstate(all="ignore"):
        inv = safe_inverse(amax)
        out = lround(x * inv[:, None]) + 1
    return fp16(amax), out
