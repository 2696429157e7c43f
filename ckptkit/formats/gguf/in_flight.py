"""What a GGUF file's writes in flight hold: buffer sets handed out again only once their
chunk is written (:class:`HeldBuffers`), and dequantized weights written a piece at a time
as they are made, Q/K rows permuted by whole heads on the way (:func:`piece_jobs`)."""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ckptkit.formats.gguf.rows import SAME, ChunkBuffers
from ckptkit.formats.writers import Job, Pieces
from ckptkit.io import ALIGN, OutputFile
from ckptkit.tensors.dtypes import tensor_bytes

if TYPE_CHECKING:
    from ckptkit.formats.gguf.gguf_tensor import GGUFTensor


class HeldBuffers(ChunkBuffers):
    """:class:`ChunkBuffers` whose sets are handed out again only once the write of the chunk
    made in them is done (:meth:`release`): the engine's workers may finish writes out of
    order, so the oldest chunk in flight is not always the one whose set comes round next."""

    def __init__(self, sets: int) -> None:
        super().__init__(sets)
        self._free = [threading.Event() for _ in range(max(1, sets))]
        for e in self._free:
            e.set()
        self.made = 0  # chunks made in a set so far
        self.turn = -1  # the set the last of them was made in

    def next_set(self) -> int:
        turn = super().next_set()
        self._free[turn].wait()  # its chunk's write is done (a worker runs it whatever this thread does)
        self._free[turn].clear()
        self.made, self.turn = self.made + 1, turn
        return turn

    def release(self, turn: int) -> None:
        self._free[turn].set()


def write_then(out: OutputFile, chunk: bytes | memoryview, offset: int, then: Callable[[], object]) -> None:
    """Write ``chunk`` at ``offset``, then call ``then`` (also when the write fails): hand the
    chunk's buffer back, or say it is written."""
    try:
        out.write(chunk, offset)
    finally:
        then()


def nothing() -> None:
    """What :func:`write_then` does after a chunk that holds no buffer of the writer's."""


def streamed(t: GGUFTensor) -> Pieces | None:
    """The pieces ``t``'s GGML bytes are made of, as they are made (a dequantized weight
    written in its own dtype: BF16's NaNs already quiet, as the ``gguf`` package's rounding
    leaves them; Q/K rows permuted by whole heads), or None: ``t`` is made otherwise (rows
    moved otherwise, another type, imatrix weights)."""
    import gguf

    source = t.source
    if source is None or source.pieces is None or t.moved is not None or t.weights is not None:
        return None
    if t.heads is not None and (len(t.shape) != 2 or t.shape[-2] % (2 * t.heads)):
        return None  # not a matrix of whole heads of two halves: the torch path says so
    return source.pieces if SAME.get(source.dtype) == gguf.GGMLQuantizationType(t.qtype).name else None


def piece_jobs(
    out: OutputFile, t: GGUFTensor, pieces: Pieces, offset: int, nbytes: int, buffers: HeldBuffers
) -> Iterator[tuple[Job, int]]:
    """The writes of ``t`` (:func:`streamed`'s ``pieces``, ``nbytes`` at file ``offset``),
    each piece asked for once the one two before it is written (it is valid until then);
    with Q/K heads, the rows permuted into ``buffers`` (:func:`_permuted`)."""
    written = 0
    held: deque[threading.Event] = deque()
    made = pieces(offset % ALIGN)
    permute = _permuted(buffers, t.shape[-2] // t.heads, nbytes // t.shape[-2]) if t.heads else None
    while True:
        if len(held) == 2:
            held.popleft().wait()
        piece = next(made, None)
        if piece is None:
            break
        data = piece if isinstance(piece, memoryview) else tensor_bytes(piece)
        if written + data.nbytes > nbytes:  # a permutation carries less than a piece: never more than planned
            raise RuntimeError(f"{t.name}: more than the {nbytes} bytes planned")
        if permute is None:
            done = threading.Event()
            yield functools.partial(write_then, out, data, offset + written, done.set), data.nbytes
            held.append(done)
            written += data.nbytes
        else:
            for chunk, turn in permute(data, offset + written):
                release = functools.partial(buffers.release, turn)
                yield functools.partial(write_then, out, chunk, offset + written, release), len(chunk)
                written += len(chunk)
    if written != nbytes:
        raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {nbytes}")


def _permuted(
    buffers: HeldBuffers, group: int, row_bytes: int
) -> Callable[[memoryview, int], Iterator[tuple[memoryview, int]]]:
    """``permute(piece, at)``: the piece's whole heads of ``group`` rows, each head's two
    halves interleaved (llama.cpp's Q/K order), in a set of ``buffers`` placed for file offset
    ``at``, with the set; the rows of a head the piece ends inside are carried into the next."""
    import numpy as np

    head = group * row_bytes
    carry = [np.empty(0, np.uint8)]

    def permute(piece: memoryview, at: int) -> Iterator[tuple[memoryview, int]]:
        rows = np.frombuffer(piece, np.uint8)
        if len(carry[0]):
            rows = np.concatenate([carry[0], rows])
        whole = len(rows) // head * head
        carry[0] = rows[whole:].copy()
        if whole:
            turn = buffers.next_set()
            buffers.lead = at % ALIGN
            chunk = buffers.get(turn, 1, whole)
            by_head = rows[:whole].reshape(-1, 2, group // 2, row_bytes)
            chunk.reshape(-1, group // 2, 2, row_bytes)[...] = by_head.swapaxes(1, 2)
            yield chunk.data, turn

    return permute
