"""IQ4_XS as ``llama-quantize`` writes it with no imatrix (ggml's ``quantize_iq4_xs``):
super-blocks of 256 values in 8 sub-blocks of 32, each sub-block's scale searched as IQ4_NL
searches it, then quantized to 6 bits against a float16 super-scale, the values the indices
of the nearest of IQ4_NL's 16 levels (scale, high scale bits, low scale bits, quants)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    best_index,
    blocks_out,
    f32,
    first_abs_max,
    fp16,
    nearest_int,
    nibbles,
    safe_inverse,
)
from ckptkit.formats.gguf.encoders.iq4_nl import VALUES, sub_block_scales

BLOCK, SIZE = 256, 136


def encode(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """The IQ4_XS bytes ``(n, 136)`` of float32 ``x`` (``n * 256`` values); with ``w`` (the
    element-major weights ``(32, n * 8)`` of an imatrix), the scale search weighted by them."""
    n = x.size // BLOCK
    sub = np.ascontiguousarray(x.reshape(n * 8, 32).T)  # (32, n * 8): element-major sub-blocks
    scales, _ = sub_block_scales(sub, w)
    # ggml's maximum passes over the all-zero sub-blocks, whose 0 can never be larger anyway
    max_scale = first_abs_max(scales.reshape(n, 8))
    with np.errstate(all="ignore"):
        d = -max_scale / f32(32)
        ls = np.clip(nearest_int(safe_inverse(d)[:, None] * scales.reshape(n, 8)), -32, 31)
        dl = (d[:, None] * ls.astype(np.float32)).reshape(-1)
        q = best_index(VALUES, safe_inverse(dl) * sub).T.reshape(n, 8, 32)
    ls = ls + 32
    scales_h = np.zeros(n, np.uint16)
    for k in range(8):
        scales_h |= ((ls[:, k] >> 4) << (2 * k)).astype(np.uint16)
    scales_l = nibbles(ls[:, 0::2], ls[:, 1::2])
    qs = nibbles(q[:, :, :16], q[:, :, 16:]).reshape(n, 128)
    return blocks_out(fp16(d), scales_h, scales_l, qs)
