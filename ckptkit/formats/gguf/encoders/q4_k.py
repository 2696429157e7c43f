"""Q4_K as ggml's ``quantize_row_q4_K_ref`` writes it: super-blocks of 256 values, 8
sub-blocks of 32 with a scale and minimum each from ``make_qkx2_quants`` (15 levels, 21
trial scales), 4-bit quants."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import blocks_out
from ckptkit.formats.gguf.encoders.qkx2 import super_blocks

BLOCK, SIZE = 256, 144


def encode(x: np.ndarray) -> np.ndarray:
    """The Q4_K bytes ``(n, 144)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    return pack(*super_blocks(x.reshape(n, BLOCK), 15, -1.0, 0.1, 20))


def pack(d: np.ndarray, dmin: np.ndarray, scales: np.ndarray, quants: np.ndarray) -> np.ndarray:
    """The Q4_K blocks of the super-scales (n,), packed scales (n, 12) and quants (n, 256)."""
    n = d.shape[0]
    q = quants.reshape(n, 4, 2, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)
    return blocks_out(d, dmin, scales, qs.reshape(n, 128))
