"""Q5_0 as ggml's ``quantize_row_q5_0_ref`` writes it: 32 values, a float16 scale from the
value of largest magnitude (over -16), 5-bit quants (low nibbles, then the fifth bits)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    as_int8,
    blocks_out,
    c_int,
    f32,
    fifth_bits,
    first_abs_max,
    fp16,
    low_byte,
    nibbles,
    safe_inverse,
)

BLOCK, SIZE = 32, 22


def encode(x: np.ndarray) -> np.ndarray:
    """The Q5_0 bytes ``(n, 22)`` of float32 ``x`` (``n * 32`` values)."""
    xt = x.reshape(-1, BLOCK)
    vmax = first_abs_max(xt)[:, None]
    d = vmax / f32(-16)
    inv = safe_inverse(d)
    with np.errstate(invalid="ignore", over="ignore"):
        q = low_byte(np.minimum(31, as_int8(c_int(xt * inv + f32(16.5)))))
    return blocks_out(fp16(d[:, 0]), fifth_bits(q), nibbles(q[:, :16], q[:, 16:]))
