"""Q5_1 as ggml's ``quantize_row_q5_1_ref`` writes it: 32 values, float16 scale and minimum
from the block's range over 31, 5-bit quants (low nibbles, then the fifth bits)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    blocks_out,
    c_int,
    f32,
    fifth_bits,
    first_extreme,
    fp16,
    low_byte,
    nibbles,
    safe_inverse,
)

BLOCK, SIZE = 32, 24


def encode(x: np.ndarray) -> np.ndarray:
    """The Q5_1 bytes ``(n, 24)`` of float32 ``x`` (``n * 32`` values)."""
    xt = x.reshape(-1, BLOCK)
    lo, hi = first_extreme(xt, False)[:, None], first_extreme(xt, True)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        d = (hi - lo) / f32(31)
        inv = safe_inverse(d)
        q = low_byte(c_int((xt - lo) * inv + f32(0.5)))
    return blocks_out(fp16(d[:, 0]), fp16(lo[:, 0]), fifth_bits(q), nibbles(q[:, :16], q[:, 16:]))
