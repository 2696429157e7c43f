"""The arithmetic of one-byte elements times the float32 scale of their block: dequantize and
re-quantize a matrix ``[rows, cols]`` scaled on a grid of ``(rows, cols)`` blocks, blocks that
overhang the matrix cropped (block FP8, compressed-tensors, modelopt FP8, Mistral's qscale).

Dequantizing is the reference recipe: the element widened to float32, times the block's
float32 scale (one rounding), one round-to-nearest-even cast to the output dtype. A stored
byte has 256 values, so where a block holds more elements than that, each block's 256 possible
results are computed by that recipe into a table and the matrix is one gather from the tables
(the same bytes, a pass over the output instead of three); smaller blocks are widened by a
lookup and multiplied in place by the scales broadcast over their blocks. The work goes a few
MiB of rows at a time, the chunks on torch's threads (numpy's gathers release the GIL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

CHUNK_ELEMENTS = 1 << 20  # elements a chunk of rows holds, about (4 MiB of float32)
TABLE_MIN_BLOCK = 1024  # elements a block needs for a table of its 256 results to pay
CODES = 256


def _row_chunks(rows: int, cols: int, br: int) -> Iterator[tuple[int, int]]:
    """(first, end) row ranges of about CHUNK_ELEMENTS elements: whole block rows of ``br``
    rows, or parts of one block row where a block row is larger than that."""
    per = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if per >= br:
        step = per // br * br
        for r0 in range(0, rows, step):
            yield r0, min(rows, r0 + step)
        return
    for b0 in range(0, rows, br):
        b1 = min(rows, b0 + br)
        for r0 in range(b0, b1, per):
            yield r0, min(b1, r0 + per)


def _each(jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` on up to torch's thread count of threads."""
    import torch

    workers = min(len(jobs), torch.get_num_threads())
    if workers <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()


def _bits(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a numpy array of unsigned ints of its item size (bf16 has no numpy dtype)."""
    import torch

    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(kinds[t.element_size()]).numpy()


def widened(stored: torch.dtype) -> torch.Tensor:
    """float32 [256]: each byte code of the one-byte dtype ``stored`` as float32 (exact)."""
    import torch

    return torch.arange(CODES, dtype=torch.uint8).view(stored).to(torch.float32)


def _blockwise(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int], op: str) -> None:
    """``x`` [rows, cols] (float32) ``op`` (``mul_`` / ``div_``) ``s`` [ceil(rows / br),
    ceil(cols / bc)] broadcast over its blocks, in place; the cropped edge blocks as their own views."""
    rows, cols = x.shape
    br, bc = block
    full_r, full_c = rows // br * br, cols // bc * bc
    for r0, r1, h in ((0, full_r, br), (full_r, rows, rows - full_r)):
        for c0, c1, w in ((0, full_c, bc), (full_c, cols, cols - full_c)):
            if r1 > r0 and c1 > c0:
                part = x[r0:r1, c0:c1].view((r1 - r0) // h, h, (c1 - c0) // w, w)
                scales = s[r0 // br : math.ceil(r1 / br), c0 // bc : math.ceil(c1 / bc)]
                getattr(part, op)(scales.unsqueeze(1).unsqueeze(3))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``weight`` [..., rows, cols] of a one-byte dtype times the float32 ``scale`` [...,
    ceil(rows / br), ceil(cols / bc)] of its ``block``, in ``dtype`` (the reference recipe)."""
    import torch

    rows, cols = weight.shape[-2:]
    if weight.numel() == 0:
        return torch.empty(weight.shape, dtype=dtype)
    br, bc = min(block[0], rows), min(block[1], cols)
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    w = weight.reshape(-1, rows, cols)
    s = scale.to(torch.float32).reshape(-1, sr, sc)
    out = torch.empty(w.shape, dtype=dtype)
    lut = widened(weight.dtype)
    codes, into = _bits(w), _bits(out)
    parts = [(e, r0, r1) for e in range(w.shape[0]) for r0, r1 in _row_chunks(rows, cols, br)]
    if br * bc >= TABLE_MIN_BLOCK:
        tables = _bits((lut * s.unsqueeze(-1)).to(dtype)).reshape(s.shape[0], -1)  # [E, sr * sc * 256]
        col_at = _col_offsets(cols, bc)
        _each([partial(_gather, codes[e, r0:r1], tables[e], col_at, br, sc, r0, into[e, r0:r1]) for e, r0, r1 in parts])
    else:
        wide = lut.numpy()
        _each([partial(_widen_scale, codes[e, r0:r1], wide, s[e], (br, bc), r0, out[e, r0:r1]) for e, r0, r1 in parts])
    return out.reshape(weight.shape)


def _col_offsets(cols: int, bc: int) -> np.ndarray:
    import numpy as np

    return (np.arange(cols, dtype=np.int32) // bc) * np.int32(CODES)


def _gather(
    codes: np.ndarray, tables: np.ndarray, col_at: np.ndarray, br: int, sc: int, r0: int, into: np.ndarray
) -> None:
    """``into`` = each code's entry in its block's table (rows ``r0``.. of the matrix)."""
    import numpy as np

    r1 = r0 + codes.shape[0]
    first = r0 // br
    table = tables[first * sc * CODES : math.ceil(r1 / br) * sc * CODES]
    index = np.add(codes, col_at, dtype=np.int32)
    if (r1 - 1) // br > first:  # the chunk spans block rows
        index += ((np.arange(r0, r1, dtype=np.int32) // br - first) * np.int32(sc * CODES))[:, None]
    np.take(table, index, out=into, mode="clip")  # every index is in range: clip checks nothing


def _widen_scale(
    codes: np.ndarray, lut: np.ndarray, s: torch.Tensor, block: tuple[int, int], r0: int, out: torch.Tensor
) -> None:
    import numpy as np
    import torch

    wide = torch.from_numpy(np.take(lut, codes))
    r1 = r0 + codes.shape[0]
    _blockwise(wide, s[r0 // block[0] : math.ceil(r1 / block[0])], (min(block[0], r1 - r0), block[1]), "mul_")
    out.copy_(wide)


def requantize(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], stored: torch.dtype) -> torch.Tensor:
    """``values`` [..., rows, cols] over the float32 ``scale`` of their ``block``, in float32,
    to the one-byte ``stored`` dtype (int8: rounded half to even and clamped to -128..127)."""
    import torch

    rows, cols = values.shape[-2:]
    if values.numel() == 0:
        return torch.empty(values.shape, dtype=stored)
    br, bc = min(block[0], rows), min(block[1], cols)
    v = values.reshape(-1, rows, cols)
    s = scale.to(torch.float32).reshape(-1, math.ceil(rows / br), math.ceil(cols / bc))
    out = torch.empty(v.shape, dtype=stored)

    def one(e: int, r0: int, r1: int) -> None:
        x = v[e, r0:r1].to(torch.float32, copy=True)
        _blockwise(x, s[e, r0 // br : math.ceil(r1 / br)], (min(br, r1 - r0), bc), "div_")
        out[e, r0:r1] = x.round_().clamp_(-128, 127) if stored == torch.int8 else x

    _each([partial(one, e, r0, r1) for e in range(v.shape[0]) for r0, r1 in _row_chunks(rows, cols, br)])
    return out.reshape(values.shape)
