"""The writers of output files: the one protocol the write engine (``writing.write_plan``)
drives, and the base class the built-in writers share.

Every output file (a safetensors file, a torch pickle, a DCP rank file, a GGUF) is laid out
when its writer is made, so each tensor has a fixed place and can be written in any order,
from any thread, by whichever way its bytes travel: a tensor in memory (``write``), bytes in
memory (``write_bytes``), byte ranges of the source files (``write_spans``), a tensor made
a piece at a time (``write_pieces``: a dequantized weight), or chunks the writer makes
itself (``chunks``: GGUF's conversions, a chunk of rows at a time).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ckptkit.io import ALIGN, AUTO, OutputFile, Span, crc32, total_bytes
from ckptkit.tensors.dtypes import tensor_bytes

if TYPE_CHECKING:
    import torch

    from ckptkit.tensors.lazy import Lazy

Job = Callable[[], object]  # one chunk's write, run on a worker thread
Submit = Callable[[Job, int], "Future[Any]"]  # runs a job of so many bytes on a worker thread
Pieces = Callable[[int], Iterator["torch.Tensor | memoryview"]]  # Lazy.pieces: a tensor's bytes a piece at a time


class TensorWriter(Protocol):
    """The writer of one output file, as the write engine uses it."""

    path: Path

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor ``name`` from memory."""
        ...

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Write tensor ``name``'s bytes (row-major, as stored)."""
        ...

    def write_spans(self, name: str, spans: list[Span], method: str = AUTO) -> str:
        """Copy tensor ``name``'s bytes file to file from ``spans`` (concatenated); returns
        the copy method used. Thread-safe for distinct names."""
        ...

    def write_pieces(self, name: str, pieces: Pieces, submit: Submit) -> None:
        """Write tensor ``name`` from ``pieces(lead)`` (its bytes in order, tensors or bytes,
        each valid until the one after the next is made: :attr:`Lazy.pieces
        <ckptkit.tensors.lazy.Lazy>`; ``lead``: the tensor's offset within a page of the
        file), each piece's write given to ``submit`` (run on a worker) while the next is made.
        Returns while the last pieces may still be written (the next tensor is made
        meanwhile): the engine waits for every job it ran before :meth:`close`."""
        ...

    def chunks(self, name: str, lazy: Lazy) -> Iterator[tuple[Job, int]] | None:
        """Tensor ``name`` made by the writer itself, a chunk at a time: each chunk's write
        as a job and its size (the engine runs the jobs on worker threads while the next
        chunk is made); None: the engine hands over the tensor (or its spans, or bytes)."""
        ...

    def close(self) -> None:
        """Finish the file (checksums, completeness) and close its descriptors."""
        ...

    def discard(self) -> None:
        """Close the file's descriptors without checking it is complete (after a failure)."""
        ...


class FileWriter:
    """A file whose layout is fixed up front, each tensor's bytes at the place
    :meth:`_place` gives; ``want_crc``: the CRC-32 of each tensor's bytes is kept
    (:meth:`_done`), for containers that record it (zip archives).

    Subclasses lay the file out (header, archive skeleton) in their constructor, then call
    ``super().__init__``, and give :meth:`_place`, :meth:`_done` and :meth:`_finish`.
    """

    want_crc: ClassVar[bool] = False
    unit: ClassVar[str] = "tensor"  # what a placed range is called in errors ("record", "chunk")

    def __init__(self, path: Path, direct: bool = False) -> None:
        self.path = path
        self._out = OutputFile(path, direct)

    def _place(self, name: str) -> tuple[int, int]:
        """(file offset, size) of tensor ``name``'s bytes."""
        raise NotImplementedError

    def _done(self, name: str, crc: int | None) -> None:
        """Tensor ``name`` is written (``crc``: its bytes' CRC-32 when ``want_crc``)."""

    def _finish(self) -> None:
        """Check the file is complete and patch in what depends on the bytes written."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_bytes(name, tensor_bytes(tensor))

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        offset, nbytes = self._place(name)
        if memoryview(data).nbytes != nbytes:
            raise ValueError(f"{name}: {memoryview(data).nbytes} bytes for a {nbytes}-byte {self.unit}")
        self._out.write(data, offset)
        self._done(name, crc32(data) if self.want_crc else None)

    def write_pieces(self, name: str, pieces: Pieces, submit: Submit) -> None:
        offset, nbytes = self._place(name)
        at, crc = 0, 0
        pending: deque[Future[Any]] = deque()
        for piece in pieces(offset % ALIGN):
            data = piece if isinstance(piece, memoryview) else tensor_bytes(piece)
            size = memoryview(data).nbytes
            if at + size > nbytes:
                raise ValueError(f"{name}: more than the {nbytes} bytes of the {self.unit}")
            if self.want_crc:
                crc = crc32(data, crc)
            pending.append(submit(functools.partial(self._out.write, data, offset + at), size))
            at += size
            if len(pending) == 2:  # the piece before this one is written: its buffer is free
                pending.popleft().result()
        if at != nbytes:
            raise ValueError(f"{name}: {at} bytes for a {nbytes}-byte {self.unit}")
        self._done(name, crc if self.want_crc else None)

    def write_spans(self, name: str, spans: list[Span], method: str = AUTO) -> str:
        offset, nbytes = self._place(name)
        if total_bytes(spans) != nbytes:
            raise ValueError(f"{name}: spans of {total_bytes(spans)} bytes for a {nbytes}-byte {self.unit}")
        done = self._out.copy(spans, offset, method, want_crc=self.want_crc)
        self._done(name, done.crc)
        return done.method

    def chunks(self, name: str, lazy: Lazy) -> Iterator[tuple[Job, int]] | None:
        return None

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self.discard()

    def discard(self) -> None:
        self._out.close()
