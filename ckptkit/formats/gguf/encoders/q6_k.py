"""Q6_K as ggml's ``quantize_row_q6_K_ref`` writes it: super-blocks of 256 values in 16
sub-blocks of 16, each sub-block's scale from ggml's ``make_qx_quants`` search (19 trial
scales, weights ``x * x``, :mod:`~ckptkit.formats.gguf.encoders.qx`), the scales quantized
to int8 against a float16 super-scale, the values to 6 bits (low nibbles, high bit pairs, scales, scale)."""

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
)
from ckptkit.formats.gguf.encoders.qx import make_qx_quants

BLOCK, SIZE = 256, 210
NMAX = 32


def encode(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """The Q6_K bytes ``(n, 210)`` of float32 ``x`` (``n * 256`` values); with imatrix weights
    ``qw`` (as ``x``), ``quantize_row_q6_K_impl``'s: the same steps, the search weighted by them."""
    n = x.size // BLOCK
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # (16, n * 16): element-major sub-blocks
    w = sub * sub if qw is None else np.ascontiguousarray(qw.reshape(n * 16, 16).T).astype(np.float32)
    scales, quants = make_qx_quants(sub, w, NMAX)
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
