"""IQ4_NL as ``llama-quantize`` writes it with no imatrix (ggml's ``quantize_iq4_nl``): 32
values, each the index of the nearest of 16 non-uniform levels, under a float16 scale found
by 15 trial scales weighted by ``x * x``."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    GROUP_MAX_EPS,
    best_index,
    blocks_out,
    f32,
    first_abs_max,
    fp16,
    nibbles,
    running_sum,
    safe_inverse,
)

BLOCK, SIZE = 32, 18
VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
NTRY = 7


def sub_block_scales(x: np.ndarray, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The scale search of ggml's ``quantize_row_iq4_nl_impl`` (``ntry`` 7) for every column
    of ``x`` (32, m), weighted by ``w`` (as ``x``; ``x * x`` when not given): the scales (m,),
    0 where the column is all (near) zero, and which columns those are."""
    vmax = first_abs_max(x.T)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    w = x * x if w is None else w

    def fit(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        wq = w * q
        return running_sum(wq * x), running_sum(wq * q)

    with np.errstate(all="ignore"):
        d = -vmax / VALUES[0]
        sumqx, sumq2 = fit(VALUES[best_index(VALUES, (f32(1) / d) * x)])
        d = np.where(sumq2 > 0, sumqx / sumq2, f32(0))
        best = d * sumqx
        for itry in range(-NTRY, NTRY + 1):
            sumqx, sumq2 = fit(VALUES[best_index(VALUES, ((f32(itry) + VALUES[0]) / vmax) * x)])
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    return np.where(zero, f32(0), d), zero


def encode(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """The IQ4_NL bytes ``(n, 18)`` of float32 ``x`` (``n * 32`` values); with ``w`` (the
    element-major weights ``(32, n)`` of an imatrix), the scale search weighted by them."""
    sub = np.ascontiguousarray(x.reshape(-1, BLOCK).T)  # (32, n): element-major blocks
    d, _ = sub_block_scales(sub, w)
    with np.errstate(all="ignore"):
        q = best_index(VALUES, safe_inverse(d) * sub).T
    return blocks_out(fp16(d), nibbles(q[:, :16], q[:, 16:]))
