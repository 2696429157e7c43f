"""The arithmetic of one-byte elements times the float32 scale of their block: dequantize and
re-quantize a matrix ``[rows, cols]`` scaled on a grid of ``(rows, cols)`` blocks, blocks that
overhang the matrix cropped (block FP8, compressed-tensors, modelopt FP8, Mistral's qscale).

Dequantizing is the reference recipe: the element widened to float32, times the block's
float32 scale (one rounding), one round-to-nearest-even cast to the output dtype. A stored
byte has 256 values, so where a block holds more elements than that, each block's 256 possible
results are computed by that recipe (torch's multiply and cast) into a table and the matrix is
one compiled gather from the tables (:mod:`ckptkit.quant.kernels`: a read of each code and a
write of each element); smaller blocks are widened and multiplied by their scale in one
compiled pass, then cast by torch. The work goes a few MiB of rows at a time, the chunks on
torch's threads (the compiled loops release the GIL).
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
PIECE_ELEMENTS = 4 * CHUNK_ELEMENTS  # elements of a piece :func:`dequantized_pieces` yields, about


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

    out = torch.empty(weight.shape, dtype=dtype)
    if weight.numel():
        fill, parts = _prepared(weight, scale, block, dtype)
        rows, cols = weight.shape[-2:]
        flat = out.view(-1, rows, cols)
        _each([partial(fill, e, r0, r1, flat[e, r0:r1]) for e, r0, r1 in parts])
    return out


def dequantized_pieces(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """:func:`dequantize`'s result flat, in order, :data:`PIECE_ELEMENTS` or so at a time,
    made in two buffers in turn: a piece is valid until the one after the next is asked for
    (so that one is written while the next is made, and the whole result is never held)."""
    import torch

    if not weight.numel():
        return
    fill, parts = _prepared(weight, scale, block, dtype)
    cols = weight.shape[-1]
    pieces: list[list[tuple[int, int, int]]] = [[]]
    for part in parts:
        if sum(r1 - r0 for _, r0, r1 in pieces[-1]) * cols >= PIECE_ELEMENTS:
            pieces.append([])
        pieces[-1].append(part)
    size = max(sum(r1 - r0 for _, r0, r1 in piece) for piece in pieces) * cols
    buffers = [torch.empty(size, dtype=dtype) for _ in range(min(2, len(pieces)))]
    for n, piece in enumerate(pieces):
        buf, at = buffers[n % 2], 0
        jobs: list[Callable[[], None]] = []
        for e, r0, r1 in piece:
            jobs.append(partial(fill, e, r0, r1, buf[at : at + (r1 - r0) * cols].view(r1 - r0, cols)))
            at += (r1 - r0) * cols
        _each(jobs)
        yield buf[:at]


Fill = Callable[[int, int, int, "torch.Tensor"], None]


def _prepared(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> tuple[Fill, list[tuple[int, int, int]]]:
    """(``fill(e, r0, r1, into)``: rows ``r0:r1`` of matrix ``e`` of ``weight``
    dequantized into ``into``, the (e, r0, r1) chunks that make the whole)."""
    import torch

    from ckptkit.quant import kernels

    rows, cols = weight.shape[-2:]
    br, bc = min(block[0], rows), min(block[1], cols)
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    codes = _bits(weight.reshape(-1, rows, cols))
    s = scale.to(torch.float32).reshape(-1, sr, sc)
    lut = widened(weight.dtype)
    parts = [(e, r0, r1) for e in range(codes.shape[0]) for r0, r1 in _row_chunks(rows, cols, br)]
    if br * bc >= TABLE_MIN_BLOCK:  # each block's 256 results cast by torch, then one gather
        tables = _bits((lut * s.unsqueeze(-1)).to(dtype)).reshape(s.shape[0], sr * sc, CODES)

        def gather(e: int, r0: int, r1: int, into: torch.Tensor) -> None:
            kernels.gather(codes[e, r0:r1], tables[e], br, bc, r0, _bits(into))

        return gather, parts
    wide, scales = lut.numpy(), s.numpy()

    def widen_scale(e: int, r0: int, r1: int, into: torch.Tensor) -> None:
        """Each code widened times its block's scale in float32, then torch's one cast."""
        product = into if into.dtype == torch.float32 else torch.empty(into.shape, dtype=torch.float32)
        kernels.widen_scale(codes[e, r0:r1], wide, scales[e], br, bc, r0, product.numpy())
        if product is not into:
            into.copy_(product)

    return widen_scale, parts


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
