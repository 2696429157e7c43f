"""The arithmetic of one-byte elements times the float32 scale of their block: dequantize and
re-quantize a matrix ``[rows, cols]`` scaled on a grid of ``(rows, cols)`` blocks, blocks that
overhang the matrix cropped (block FP8, compressed-tensors, modelopt FP8, Mistral's qscale).

Dequantizing is the reference recipe: the element widened to float32, times the block's
float32 scale (one rounding), one round-to-nearest-even cast to the output dtype. A stored
byte has 256 values, so where a block holds more elements than that, each block's 256 possible
results are computed by that recipe (numpy's multiply and a cast bit for bit torch's:
:mod:`ckptkit.tensors.float_bits`) into a table and the matrix is one compiled gather from the
tables (:mod:`ckptkit.quant.kernels`: a read of each code and a write of each element, four
at a time for two-byte results); smaller blocks are widened and multiplied by their scale in
one compiled pass, then cast the same way. The work goes a few MiB of rows at a time, the
chunks on this thread and a pool's (:func:`workers` in all: the compiled loops release the
GIL); a weight written in pieces is read from the source a piece at a time too, with its
scale's stored bytes, without torch (:func:`dequantized_pieces`).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING

from ckptkit.io import ALIGN, SpanReader, take
from ckptkit.tensors import float_bits
from ckptkit.tensors.dtypes import dtype_name, to_torch

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy

CHUNK_ELEMENTS = 1 << 20  # elements a chunk of rows holds, about (4 MiB of float32)
TABLE_MIN_BLOCK = 1024  # elements a block needs for a table of its 256 results to pay
CODES = 256
TABLE_SCALES = 64  # scales whose tables are computed at a time (64 KiB of float32 products)
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


def workers() -> int:
    """Threads a matrix is dequantized on: torch's thread count where torch is loaded (a
    caller may have set it), else the CPUs this process may run on."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _each(jobs: Sequence[Callable[[], None]]) -> None:
    """Run ``jobs`` on this thread and up to :func:`workers` less one of the pool's."""
    threads = workers()
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    pool = _pool(threads - 1)
    futures = [pool.submit(job) for job in jobs[1:]]
    try:
        jobs[0]()
    finally:
        wait(futures)  # every job done (none still filling a buffer) before any error is raised
    for f in futures:
        f.result()


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's pools, whose threads the child does not have, dropped."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, made once (not a pool and its threads per chunk)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="ckptkit-quant")
        return _pools[workers]


def _bits(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a numpy array of unsigned ints of its item size (bf16 has no numpy dtype)."""
    import torch

    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(kinds[t.element_size()]).numpy().view(f"u{t.element_size()}")


def scale_values(scales: Sequence[Lazy]) -> np.ndarray:
    """The one scale tensor of a weight as float32 (numpy): from its stored bytes without
    torch where it has them (:attr:`Lazy.raw`: read from the source and checked), else read
    by torch."""
    if len(scales) != 1:
        raise ValueError(f"{len(scales)} scale tensors for one multiplying scale")
    (scale,) = scales
    if scale.raw is not None:
        return float_bits.as_float32(scale.raw(), scale.dtype, scale.shape)
    return _float32(scale.get())


def _float32(scale: torch.Tensor) -> np.ndarray:
    import torch

    return scale.to(torch.float32).contiguous().numpy()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``weight`` [..., rows, cols] of a one-byte dtype times the float32 ``scale`` [...,
    ceil(rows / br), ceil(cols / bc)] of its ``block``, in ``dtype`` (the reference recipe)."""
    import torch

    out = torch.empty(weight.shape, dtype=dtype)
    if weight.numel():
        rows, cols = weight.shape[-2:]
        fill = _prepared(dtype_name(weight.dtype), rows, cols, _float32(scale), block, dtype_name(dtype))
        codes = _bits(weight.reshape(-1, rows, cols))
        flat = _bits(out.view(-1, rows, cols))
        _each([partial(fill, codes[e, r0:r1], e, r0, flat[e, r0:r1]) for e, r0, r1 in _parts(weight.shape, block)])
    return out


def dequantized_pieces(
    weight: torch.Tensor | Lazy,
    scale: np.ndarray | torch.Tensor,
    block: tuple[int, int],
    dtype: str | torch.dtype,
    lead: int = 0,
) -> Iterator[memoryview]:
    """:func:`dequantize`'s result flat, in order, as bytes, :data:`PIECE_ELEMENTS` or so
    elements at a time, made in two buffers in turn: a piece is valid until the one after
    the next is asked for (so that one is written while the next is made, and the whole
    result is never held).

    ``weight`` may be lazy: where its bytes lie in the source files (:meth:`Lazy.spans`),
    each piece's codes are read from there into a buffer (the weight is never held whole),
    and with a float32 numpy ``scale`` (:func:`scale_values`) no torch is imported.
    ``lead``: where in a page the result's first byte goes in the file; each piece lies in
    memory where it goes in its page, so that a direct write takes it from where it lies
    (:func:`ckptkit.io.direct.write_parts`)."""
    import numpy as np

    from ckptkit.tensors.lazy import Lazy

    shape = tuple(weight.shape)
    if not math.prod(shape):
        return
    rows, cols = shape[-2:]
    stored = dtype_name(weight.dtype)
    spans = weight.spans() if isinstance(weight, Lazy) else None
    held = None if spans is not None else weight.get() if isinstance(weight, Lazy) else weight
    values = scale if isinstance(scale, np.ndarray) else _float32(scale)
    dtype = dtype_name(dtype)
    fill = _prepared(stored, rows, cols, values, block, dtype)
    pieces: list[list[tuple[int, int, int]]] = [[]]
    for part in _parts(shape, block):
        if sum(r1 - r0 for _, r0, r1 in pieces[-1]) * cols >= PIECE_ELEMENTS:
            pieces.append([])
        pieces[-1].append(part)
    most = max(sum(r1 - r0 for _, r0, r1 in piece) for piece in pieces) * cols  # elements of the largest piece
    bits = np.dtype(float_bits.ROUNDED[dtype])
    taken = [np.empty(most * bits.itemsize + ALIGN, np.uint8) for _ in range(min(2, len(pieces)))]
    read = np.empty(most if spans is not None else 0, np.uint8)
    reader = SpanReader()
    done = lead  # where the next piece starts in the file, within its page and on
    try:
        codes = None if held is None else _bits(held.reshape(-1, rows, cols))
        for n, piece in enumerate(pieces):
            e0, first, _ = piece[0]
            count = sum(r1 - r0 for _, r0, r1 in piece) * cols
            if spans is not None:  # the piece's codes: one run of the weight's bytes
                reader.read_into(take(spans, (e0 * rows + first) * cols, count), read[:count].data)
                run = read[:count].reshape(-1, cols)
            buffer = taken[n % 2]
            start = (done - buffer.ctypes.data) % ALIGN if done % bits.itemsize == 0 else 0  # as in its page
            out = buffer[start : start + count * bits.itemsize].view(bits)
            done += count * bits.itemsize
            jobs: list[Callable[[], None]] = []
            at = 0
            for e, r0, r1 in piece:
                here = run[at : at + r1 - r0] if codes is None else codes[e, r0:r1]
                jobs.append(partial(fill, here, e, r0, out[at * cols : (at + r1 - r0) * cols].reshape(r1 - r0, cols)))
                at += r1 - r0
            _each(jobs)
            yield out.data.cast("B")
    except BaseException:
        reader.close(check=False)
        raise
    reader.close()  # a zip source's record CRC-32s, before the weight counts as written


Fill = Callable[["np.ndarray", int, int, "np.ndarray"], None]


def _parts(shape: tuple[int, ...], block: tuple[int, int]) -> list[tuple[int, int, int]]:
    """The (e, r0, r1) chunks of rows that make matrices ``e`` of a weight of ``shape``."""
    rows, cols = shape[-2:]
    count = math.prod(shape[:-2])
    return [(e, r0, r1) for e in range(count) for r0, r1 in _row_chunks(rows, cols, min(block[0], rows))]


def _prepared(stored: str, rows: int, cols: int, scale: np.ndarray, block: tuple[int, int], dtype: str) -> Fill:
    """``fill(codes, e, r0, into)``: the one-byte ``codes`` (uint8) of rows ``r0:`` of matrix
    ``e`` of a weight of ``stored`` [..., rows, cols] with the float32 ``scale``, dequantized
    into ``into`` (the bits of ``dtype``: :data:`float_bits.ROUNDED`)."""
    import numpy as np

    from ckptkit.quant import kernels

    br, bc = min(block[0], rows), min(block[1], cols)
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    s = np.ascontiguousarray(scale, np.float32).reshape(-1, sr, sc)
    lut = float_bits.widened(stored)
    if br * bc >= TABLE_MIN_BLOCK:  # each block's 256 results cast, then one gather
        flat = s.reshape(-1)
        made = np.empty((flat.size, CODES), float_bits.ROUNDED[dtype])
        for i in range(0, flat.size, TABLE_SCALES):  # small temporaries: no fresh pages to fault in
            with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN as the recipe makes them
                products = np.multiply.outer(flat[i : i + TABLE_SCALES], lut)
            made[i : i + TABLE_SCALES] = _cast(products, dtype)
        tables = made.reshape(s.shape[0], sr * sc, CODES)
        by_four = tables.itemsize == 2 and cols % 4 == 0 and bc % 4 == 0 and kernels.LITTLE_ENDIAN

        def gather(codes: np.ndarray, e: int, r0: int, into: np.ndarray) -> None:
            if by_four and codes.flags.c_contiguous and into.flags.c_contiguous:
                kernels.gather4(codes, tables[e], br, bc, r0, into)
            else:
                kernels.gather(codes, tables[e], br, bc, r0, into)

        return gather

    def widen_scale(codes: np.ndarray, e: int, r0: int, into: np.ndarray) -> None:
        """Each code widened times its block's scale in float32, then one cast."""
        product = into.view(np.float32) if dtype == "float32" else np.empty(into.shape, np.float32)
        kernels.widen_scale(codes, lut, s[e], br, bc, r0, product)
        if dtype != "float32":
            into[...] = _cast(product, dtype)

    return widen_scale


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bits of float32 ``values`` cast to ``dtype``: :func:`float_bits.rounded`, or
    torch's cast where that is not known to give torch's bytes (:data:`float_bits.LIKE_TORCH`)."""
    if float_bits.LIKE_TORCH:
        return float_bits.rounded(values, dtype)
    import torch

    return _bits(torch.from_numpy(values).to(to_torch(dtype)))


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
