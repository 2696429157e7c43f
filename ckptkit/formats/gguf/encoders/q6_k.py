"""Q6_K as ggml's ``quantize_row_q6_K_ref`` writes it: super-blocks of 256 values in 16
sub-blocks of 16, each sub-block's scale from ggml's ``make_qx_quants`` search (19 trial
scales, weights ``x * x``), the scales quantized to int8 against a float16 super-scale, the
values to 6 bits (low nibbles, high bit pairs, scales, scale)."""

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

BLOCK, SIZE = 256, 210
NMAX = 32


def make_qx_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(16, 32, x, L, rmse_type=1, NULL)`` for every column of ``x`` (16, m):
    the scales (m,) and the quants ``L`` (16, m), 0..63."""
    vmax = first_abs_max(x.T)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def levels(iscale: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip(nearest_int(iscale * x), -NMAX, NMAX - 1)
        return out

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lf = levels(iscale).astype(np.float32)
        return running_sum(wx * lf), running_sum(w * lf * lf)

    # each column's quants are those of its best trial scale, made again at the end
    with np.errstate(all="ignore"):
        best_iscale = f32(-NMAX) / vmax
        sumlx, suml2 = fit(best_iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(np.float32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(f32(NMAX) + f32(0.1) * f32(step)) / vmax
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            best_iscale = np.where(better, iscale, best_iscale)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
        quants = levels(best_iscale) + NMAX
    return np.where(zero, f32(0), scale), np.where(zero, 0, quants)


def encode(x: np.ndarray) -> np.ndarray:
    """The Q6_K bytes ``(n, 210)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # (16, n * 16): element-major sub-blocks
    scales, quants = make_qx_quants(sub)
    scales = scales.reshape(n, 16)
    max_scale = first_abs_max(scales)
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = f32(-128) / max_scale
        d = fp16(f32(1) / iscale)
        q_scales = as_int8(np.minimum(127, nearest_int(iscale[:, None] * scales)))
        sub_d = (d.astype(np.float32)[:, None] * q_scales.astype(np.float32)).reshape(-1)
        again = np.clip(nearest_int(sub / sub_d), -32, 31) + 32
    quants = np.where(sub_d != 0, again, quants).T.reshape(n, 2, 4, 32)
    ql = (quants[:, :, :2] & 0x0F) | ((quants[:, :, 2:] & 0x0F) << 4)  # (n, 2, 2, 32)
    hi = quants >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = blocks_out(ql.reshape(n, 128), qh.reshape(n, 64), q_scales & 0xFF, d)
    out[empty] = 0
    return out
