"""Q4_0 as ggml's ``quantize_row_q4_0_ref`` writes it: 32 values, a float16 scale from the
value of largest magnitude (over -8), 4-bit quants."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    as_int8,
    blocks_out,
    c_int,
    f32,
    first_abs_max,
    fp16,
    low_byte,
    safe_inverse,
)

BLOCK, SIZE = 32, 18


def encode(x: np.ndarray) -> np.ndarray:
    """The Q4_0 bytes ``(n, 18)`` of float32 ``x`` (``n * 32`` values)."""
    xt = x.reshape(-1, BLOCK)
    vmax = first_abs_max(xt)[:, None]
    d = vmax / f32(-8)
    inv = safe_inverse(d)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.minimum(15, as_int8(c_int(xt * inv + f32(8.5))))
    return blocks_out(fp16(d[:, 0]), (low_byte(q[:, :16]) | (q[:, 16:] << 4)) & 0xFF)
