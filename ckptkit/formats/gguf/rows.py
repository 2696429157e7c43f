"""Tensor bytes for a GGUF without torch: the source's rows read by span into a reused buffer,
permuted a whole head at a time, and written as stored, widened to F32 or quantized to Q8_0
with numpy, a chunk of rows at a time.

Only what needs no arithmetic beyond llama.cpp's exact casts goes this way: a tensor whose
bytes lie in the source files as stored (:meth:`~ckptkit.tensors.lazy.Lazy.spans`), of at
most two dimensions, untransformed, Q/K-permuted, its rows taken in another order
(:func:`reordered`) or blocks of its rows transposed (:class:`Moved`: DeepSeek's
``attn_k_b``, Qwen3.5's ``ssm_out`` columns), written as its own type, as F32 (a norm's
``1 + w`` added in float32 as llama.cpp adds it, bfloat16 ``A_log`` as torch's ``-exp`` of it,
:mod:`.torch_exp`), or as Q8_0. Anything else (a cast that
may overflow, computed tensors) is :func:`~ckptkit.formats.gguf.quants.quantized_chunks`'
work, with torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptkit.formats.gguf.gguf_tensor import Moved
from ckptkit.formats.gguf.quants import quantize_q8_0
from ckptkit.formats.gguf.torch_exp import TORCH_EXP_MEASURED, neg_exp_bf16
from ckptkit.io import ALIGN, Span, SpanReader, take, take_rows
from ckptkit.tensors.lazy import Lazy
from ckptkit.tensors.transforms import rope_rows

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from ckptkit.io import Rows

CHUNK_BYTES = 8 << 20  # source bytes read at a time (whole rows, whole heads)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # stored as is


def reordered(lazy: Lazy, order: Rows | None, shape: tuple[int, ...] | None = None) -> Lazy:
    """``lazy`` viewed as ``shape`` (the same bytes; default its own) with the rows ``order``
    (None: all, as they are): a tensor whose spans are those rows' where ``lazy``'s bytes lie
    in the source as stored."""
    view = shape or (lazy.shape[0] if order is None else len(order), *lazy.shape[1:])
    row_bytes = math.prod(view[1:]) * ITEMSIZE.get(lazy.dtype, 0)

    def spans() -> list[Span] | None:
        if lazy.rows is not None:
            return lazy.rows(range(view[0]) if order is None else order)
        whole = lazy.spans()
        return whole if whole is None or order is None else take_rows(whole, row_bytes, order)

    def get() -> torch.Tensor:
        import torch

        t = lazy.get().reshape(-1, *view[1:])
        return t if order is None else t[torch.as_tensor(order, dtype=torch.long)]

    return Lazy(view, lazy.dtype, get, lazy.file, spans=spans)


def streamable(lazy: Lazy, kind: str, moved: Moved | None = None) -> bool:
    """Whether :func:`row_chunks` writes ``lazy`` as GGML type ``kind`` (by name)."""
    if lazy.dtype not in ITEMSIZE or not 1 <= len(lazy.shape) <= 2:
        return False
    if moved is not None and moved.plus_one:  # llama.cpp adds 1 to a float16 norm in float16
        return kind == "F32" and lazy.dtype in ("float32", "bfloat16")
    if moved is not None and moved.neg_exp:  # torch's float32 exp, reproduced for bfloat16 inputs only
        return kind == "F32" and lazy.dtype == "bfloat16" and TORCH_EXP_MEASURED
    return kind in ("F32", "Q8_0") or SAME[lazy.dtype] == kind


def head_order(rows: int, heads: int) -> npt.NDArray[np.int64]:
    """llama.cpp's Q/K permutation as row indices: output row ``i`` is source row ``order[i]``
    (rows grouped by head, each head's two halves interleaved): ckptkit's HF -> Meta rope rows."""
    return rope_rows(rows, heads, to_meta=True)


class ChunkBuffers:
    """The buffers chunks are made in, ``sets`` sets used in turn by consecutive chunks
    (of one tensor or the next): a chunk's bytes hold while the next ``sets - 1`` chunks
    are made, so a writer may have that many chunks in flight. Reused from tensor to
    tensor (no fresh pages to fault in for each); freed with the object.

    ``lead``, set by the writer before it asks for a chunk, is where in its page the
    chunk's destination starts (its file offset modulo :data:`~ckptkit.io.ALIGN`): the
    buffers start as far into a page, so that the chunk's whole pages go ``O_DIRECT`` from
    where they lie, not through a staging copy.
    """

    def __init__(self, sets: int = 1) -> None:
        self._sets: list[dict[int, np.ndarray]] = [{} for _ in range(max(1, sets))]
        self._turn = -1
        self.lead = 0

    def next_set(self) -> int:
        """The set the next chunk is made in."""
        self._turn = (self._turn + 1) % len(self._sets)
        return self._turn

    def get(self, turn: int, which: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of buffer ``which`` (0: the rows as read, 1: as permuted) of set ``turn``,
        starting :attr:`lead` bytes into a page."""
        import numpy as np

        buf = self._sets[turn].get(which)
        if buf is None or buf.nbytes < ALIGN + nbytes:
            whole = np.empty(2 * ALIGN + max(nbytes, CHUNK_BYTES), np.uint8)
            buf = self._sets[turn][which] = whole[-whole.ctypes.data % ALIGN :][: ALIGN + max(nbytes, CHUNK_BYTES)]
        return buf[self.lead % ALIGN :][:nbytes]


def row_chunks(
    lazy: Lazy,
    kind: str,
    heads: int | None,
    reader: SpanReader | None = None,
    buffers: ChunkBuffers | None = None,
    moved: Moved | None = None,
) -> Iterator[memoryview] | None:
    """The GGML bytes of ``lazy`` as type ``kind``, Q/K-permuted over ``heads`` heads when
    given, else rearranged as ``moved`` says; None when its bytes do not lie in the source
    as stored. With ``reader`` (shared
    by a whole file's tensors) the source records' CRC-32s are checked by its ``close()``,
    which the caller must call before publishing; without, before the last chunk is given.
    Chunks are made in ``buffers`` (shared by a whole file's tensors; default: a set of its
    own, each chunk's bytes holding until the next is made)."""
    moved = moved or Moved()
    if not streamable(lazy, kind, moved):
        return None
    rows = lazy.shape[0]
    if heads is not None and rows % (2 * heads):
        return None  # not whole heads: the torch path says so
    if rows % moved.rows or moved.axes and math.prod(moved.shape) * rows != math.prod(lazy.shape) * moved.rows:
        return None  # not whole blocks
    row_bytes = math.prod(lazy.shape[1:]) * ITEMSIZE[lazy.dtype]
    if heads is not None and lazy.rows is not None:
        # rows stored permuted (Meta's Q/K): the two permutations composed (back to the stored order)
        spans, heads = lazy.rows(head_order(rows, heads)), None
    else:
        spans = lazy.spans()  # permuted in memory, a whole head at a time, if heads are given
    if spans is None:
        return None
    return _chunks(spans, lazy.dtype, kind, rows, row_bytes, heads, reader, buffers or ChunkBuffers(), moved)


def _chunks(
    spans: list[Span],
    dtype: str,
    kind: str,
    rows: int,
    row_bytes: int,
    heads: int | None,
    shared: SpanReader | None,
    buffers: ChunkBuffers,
    moved: Moved,
) -> Iterator[memoryview]:
    group = rows // heads if heads else moved.rows  # rows moved together
    step = max(1, CHUNK_BYTES // max(1, group * row_bytes)) * group
    reader = shared or SpanReader()
    try:
        for first in range(0, rows, step):
            n = min(step, rows - first)
            turn = buffers.next_set()
            raw = buffers.get(turn, 0, n * row_bytes)
            reader.read_into(take(spans, first * row_bytes, n * row_bytes), raw.data)  # CRC-32s fed here
            if heads:
                out = buffers.get(turn, 1, n * row_bytes)
                by_head = raw.reshape(n // group, 2, group // 2, row_bytes)
                out.reshape(n // group, group // 2, 2, row_bytes)[...] = by_head.swapaxes(1, 2)
                raw = out
            elif moved.axes:
                out = buffers.get(turn, 1, n * row_bytes)
                blocks = raw.reshape(n // group, *moved.shape, ITEMSIZE[dtype])
                axes = (0, *(a + 1 for a in moved.axes), len(moved.shape) + 1)
                out.reshape([blocks.shape[a] for a in axes])[...] = blocks.transpose(axes)
                raw = out
            encoded = _encoded(raw, dtype, kind, moved)
            yield encoded.reshape(-1).data
    except BaseException:
        if shared is None:
            reader.close(check=False)
        raise
    if shared is None:
        reader.close()  # the source records' CRC-32s, before the tensor counts as written


def _encoded(raw: np.ndarray, dtype: str, kind: str, moved: Moved | None = None) -> np.ndarray:
    """``raw`` (stored bytes of ``dtype``) as GGML type ``kind`` (F32 of its values + 1 or of
    their ``-exp`` where ``moved`` says so)."""
    import numpy as np

    if moved is not None and moved.neg_exp:
        return neg_exp_bf16(raw.view(np.uint16)).view(np.uint8)
    if moved is not None and moved.plus_one:  # float32 addition rounds as llama.cpp's torch's (IEEE, to nearest)
        values = _encoded(raw, dtype, "F32").view(np.float32)
        return np.add(values, np.float32(1), dtype=np.float32).view(np.uint8)

    if kind == "Q8_0":
        if dtype == "bfloat16":
            return quantize_q8_0(raw.view(np.uint16).reshape(-1, 32), bf16=True)
        return quantize_q8_0(raw.view(np.float16 if dtype == "float16" else np.float32).reshape(-1, 32))
    if kind == "F32" and dtype == "bfloat16":
        wide = raw.view(np.uint16).astype(np.uint32)
        wide <<= 16
        return wide.view(np.uint8)
    if kind == "F32" and dtype == "float16":
        return raw.view(np.float16).astype(np.float32).view(np.uint8)
    if dtype == "bfloat16":  # BF16 as float32 -> BF16 rounding gives it: NaNs get their quiet bit
        bits = raw.view(np.uint16)
        if _has_nan_bf16(bits):  # a new array: the read buffer stays as read
            nan = (bits & 0x7FFF) > 0x7F80
            return (bits | np.where(nan, np.uint16(0x0040), np.uint16(0))).view(np.uint8)
        return raw
    return raw  # F32 from float32, F16 from float16: the stored bytes


NAN_SCAN = 1 << 16  # bfloat16 values checked at a time, in a scratch array that stays in cache


def _has_nan_bf16(bits: np.ndarray) -> bool:
    """Whether the bfloat16 values ``bits`` hold a NaN (no temporaries the size of ``bits``)."""
    import numpy as np

    scratch = np.empty(min(bits.size, NAN_SCAN), np.uint16)
    for start in range(0, bits.size, NAN_SCAN):
        part = bits[start : start + NAN_SCAN]
        magnitude = scratch[: part.size]
        np.bitwise_and(part, 0x7FFF, out=magnitude)
        if magnitude.max() > 0x7F80:
            return True
    return False
