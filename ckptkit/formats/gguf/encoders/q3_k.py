"""Q3_K as ggml's ``quantize_row_q3_K_ref`` writes it: super-blocks of 256 values in 16
sub-blocks of 16, each sub-block's scale from ``make_q3_quants`` (a rounding, then up to 5
passes moving one quant at a time while the weighted fit improves), the scales quantized to
6 bits against a float16 super-scale, the values to 3 bits (high bits, low bit pairs,
scales, scale)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    GROUP_MAX_EPS,
    as_int8,
    blocks_out,
    f32,
    first_abs_max,
    fp16,
    nearest_int,
    running_sum,
)

BLOCK, SIZE = 256, 110
NMAX = 4


def make_q3_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``make_q3_quants(16, 4, x, L, true)`` for every column of ``x`` (16, m): the scales
    (m,) and the quants ``L`` (16, m), 0..7."""
    vmax = first_abs_max(x.T)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(all="ignore"):
        lq = np.clip(nearest_int((f32(-NMAX) / vmax) * x), -NMAX, NMAX - 1)
        lf = lq.astype(np.float32)
        sumlx, suml2 = running_sum(wx * lf), running_sum(w * lf * lf)
        for _ in range(5):  # a pass that changes nothing leaves the next ones nothing to change
            for i in range(x.shape[0]):
                li = lq[i].astype(np.float32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new = np.clip(nearest_int(x[i] * sl2 / slx), -NMAX, NMAX - 1)
                nf = new.astype(np.float32)
                take = (slx > 0) & (new != lq[i])
                slx = slx + wx[i] * nf
                sl2 = sl2 + w[i] * nf * nf
                take &= sl2 > 0
                take &= slx * slx * suml2 > sumlx * sumlx * sl2
                lq[i] = np.where(take, new, lq[i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    return np.where(zero, f32(0), scale), np.where(zero, 0, lq + NMAX)


def encode(x: np.ndarray) -> np.ndarray:
    """The Q3_K bytes ``(n, 110)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # (16, n * 16): element-major sub-blocks
    scales, quants = make_q3_quants(sub)
    scales = scales.reshape(n, 16)
    max_scale = first_abs_max(scales)
    some = max_scale != 0
    with np.errstate(all="ignore"):
        iscale = f32(-32) / max_scale
        ls = np.where(some[:, None], np.clip(as_int8(nearest_int(iscale[:, None] * scales)), -32, 31) + 32, 0)
        d = fp16(np.where(some, f32(1) / iscale, f32(0)))
    return pack(sub, quants, ls, d)


def pack(sub: np.ndarray, quants: np.ndarray, ls: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The last Q3_K steps: each value of the sub-blocks ``sub`` (16, n * 16) quantized again
    against its 6-bit scale ``ls`` (n, 16), 0..63 for -32..31, under the float16 ``d`` (n,)
    (a sub-block of scale 0 keeps the search's ``quants``, 0..7), then the blocks."""
    n = d.shape[0]
    with np.errstate(all="ignore"):
        sub_d = (d.astype(np.float32)[:, None] * (ls - 32).astype(np.float32)).reshape(-1)
        again = np.clip(nearest_int(sub / sub_d), -4, 3) + 4
    q = np.where(sub_d != 0, again, quants).T.reshape(n, 256)
    hmask = np.zeros((n, 32), np.int32)
    for k in range(8):  # bit k of hmask[m]: the high bit of quant 32 k + m
        hmask |= (q[:, 32 * k : 32 * k + 32] >> 2 & 1) << k
    low = (q & 3).reshape(n, 2, 4, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)
    packed = np.zeros((n, 12), np.int32)
    packed[:, :8] = (ls[:, :8] & 0x0F) | ((ls[:, 8:] & 0x0F) << 4)
    for k in range(4):
        packed[:, 8:] |= (ls[:, 4 * k : 4 * k + 4] >> 4) << (2 * k)
    return blocks_out(hmask, qs.reshape(n, 64), packed, d)
