"""TQ1_0 as ggml's ``quantize_row_tq1_0_ref`` writes it: super-blocks of 256 ternary values
(-1, 0, 1 times a float16 scale, the block's largest magnitude), five trits a byte in base 3
for 240 of them and four (and a zero) for the last 16, scaled to fill the byte."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import blocks_out, trits

BLOCK, SIZE = 256, 54


def _base3(digits: list[np.ndarray]) -> np.ndarray:
    """The byte of trits ``digits`` (most significant first, a uint8 at each step), its 243
    values spread over 256 by ceiling division."""
    q = np.zeros_like(digits[0])
    for t in digits:
        q = (q * 3 + t) & 0xFF
    out: np.ndarray = (q * 256 + 242) // 243 & 0xFF
    return out


def encode(x: np.ndarray) -> np.ndarray:
    """The TQ1_0 bytes ``(n, 54)`` of float32 ``x`` (``n * 256`` values)."""
    n = x.size // BLOCK
    d, t = trits(x.reshape(n, BLOCK))
    head = t[:, :160].reshape(n, 5, 32)  # byte m of 32: values m, m + 32, ..., m + 128
    mid = t[:, 160:240].reshape(n, 5, 16)  # byte 32 + m of 16: values 160 + m, ..., 160 + m + 64
    tail = t[:, 240:].reshape(n, 4, 4)  # qh byte j: values 240 + j, 244 + j, 248 + j, 252 + j
    qs = np.concatenate([_base3([head[:, k] for k in range(5)]), _base3([mid[:, k] for k in range(5)])], axis=1)
    qh = _base3([tail[:, k] for k in range(4)] + [np.zeros_like(tail[:, 0])])
    return blocks_out(qs, qh, d)
