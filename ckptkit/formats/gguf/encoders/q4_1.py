"""Q4_1 as ggml's ``quantize_row_q4_1_ref`` writes it: 32 values, float16 scale and minimum
from the block's range over 15, 4-bit quants."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    as_int8,
    blocks_out,
    c_int,
    f32,
    first_extreme,
    fp16,
    low_byte,
    safe_inverse,
)

BLOCK, SIZE = 32, 20


def encode(x: np.ndarray) -> np.ndarray:
    """The Q4_1 bytes ``(n, 20)`` of float32 ``x`` (``n * 32`` values)."""
    xt = x.reshape(-1, BLOCK)
    lo, hi = first_extreme(xt, False)[:, None], first_extreme(xt, True)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        d = (hi - lo) / f32(15)
        inv = safe_inverse(d)
        q = np.minimum(15, as_int8(c_int((xt - lo) * inv + f32(0.5))))
    return blocks_out(fp16(d[:, 0]), fp16(lo[:, 0]), (low_byte(q[:, :16]) | (q[:, 16:] << 4)) & 0xFF)
