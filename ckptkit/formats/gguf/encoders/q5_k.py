"""Q5_K as ggml's ``quantize_row_q5_K_ref`` writes it: super-blocks of 256 values, 8
sub-blocks of 32 with a scale and minimum each from ``make_qkx2_quants`` (31 levels, 16
trial scales), 5-bit quants (fifth bits, then low nibbles)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import blocks_out
from ckptkit.formats.gguf.encoders.qkx2 import super_blocks

BLOCK, SIZE = 256, 176


def encode(x: np.ndarray) -> np.ndarray:
    """The Q5_K bytes ``(n, 176)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    return pack(*super_blocks(x.reshape(n, BLOCK), 31, -0.5, 0.1, 15))


def pack(d: np.ndarray, dmin: np.ndarray, scales: np.ndarray, quants: np.ndarray) -> np.ndarray:
    """The Q5_K blocks of the super-scales (n,), packed scales (n, 12) and quants (n, 256)."""
    n = d.shape[0]
    q = quants.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)
    high = q >> 4  # (n, 4, 2, 32): bit 2k of qh[j] for quant 64k + j, bit 2k + 1 for 64k + 32 + j
    qh = np.zeros((n, 32), np.int32)
    for k in range(4):
        qh |= (high[:, k, 0] << (2 * k)) | (high[:, k, 1] << (2 * k + 1))
    return blocks_out(d, dmin, scales, qh, qs.reshape(n, 128))
