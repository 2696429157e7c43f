"""Q2_K as ggml's ``quantize_row_q2_K_ref`` writes it: super-blocks of 256 values in 16
sub-blocks of 16, each sub-block's scale and minimum from ``make_qkx2_quants`` (3 levels,
16 trial scales, absolute errors weighted by ``|x|``), both quantized to 4 bits under two
float16 super-scales, the values to 2 bits (scales, quants, scale, minimum scale)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import blocks_out, f32, fp16, low_byte, nearest_int
from ckptkit.formats.gguf.encoders.qkx2 import make_qkx2_quants, positive_max

BLOCK, SIZE = 256, 84


def encode(x: np.ndarray) -> np.ndarray:
    """The Q2_K bytes ``(n, 84)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # (16, n * 16): element-major sub-blocks
    scales, mins, quants = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale, max_min = positive_max(scales), positive_max(mins)
    with np.errstate(all="ignore"):
        inv_scale = (f32(15) / max_scale)[:, None]
        inv_min = (f32(15) / max_min)[:, None]
        ls = np.where(max_scale[:, None] > 0, low_byte(nearest_int(inv_scale * scales)), 0)
        lm = np.where(max_min[:, None] > 0, low_byte(nearest_int(inv_min * mins) << 4), 0)
        d = fp16(np.where(max_scale > 0, max_scale / f32(15), f32(0)))
        dmin = fp16(np.where(max_min > 0, max_min / f32(15), f32(0)))
    return pack(sub, quants, ls | lm, d, dmin)


def pack(sub: np.ndarray, quants: np.ndarray, packed: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """The last Q2_K steps: each value of the sub-blocks ``sub`` (16, n * 16) quantized again
    against its packed 4-bit scale and minimum ``packed`` (n, 16) under the float16 ``d`` and
    ``dmin`` (n,) (a sub-block of scale 0 keeps the search's ``quants``), then the blocks."""
    n = d.shape[0]
    with np.errstate(all="ignore"):
        sub_d = (d.astype(np.float32)[:, None] * (packed & 0x0F).astype(np.float32)).reshape(-1)
        sub_m = (dmin.astype(np.float32)[:, None] * (packed >> 4).astype(np.float32)).reshape(-1)
        again = np.clip(nearest_int((sub + sub_m) / sub_d), 0, 3)
    q = np.where(sub_d != 0, again, quants).T.reshape(n, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return blocks_out(packed, qs.reshape(n, 64), d, dmin)
