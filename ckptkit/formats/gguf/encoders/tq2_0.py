"""TQ2_0 as ggml's ``quantize_row_tq2_0_ref`` writes it: super-blocks of 256 ternary values
(-1, 0, 1 times a float16 scale, the block's largest magnitude), 2 bits each."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import blocks_out, trits

BLOCK, SIZE = 256, 66


def encode(x: np.ndarray) -> np.ndarray:
    """The TQ2_0 bytes ``(n, 66)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    d, t = trits(x.reshape(n, BLOCK))
    q = (t & 3).reshape(n, 2, 4, 32)  # byte 32 j + m: values 128 j + m + 32 k at bits 2 k
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return blocks_out(qs.reshape(n, 64), d)
