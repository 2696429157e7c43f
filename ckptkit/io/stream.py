"""One pass over the source: read into a small reused buffer, checksum there, write out.

A tensor's spans (:mod:`ckptkit.io.spans`) are grouped into *windows*: at most
:data:`BUFFER` contiguous source bytes, read with one ``preadv`` and written with one
``pwritev`` whose pieces follow the destination order (so a row permutation inside a
window is just the order of the pieces). While the bytes are in the buffer they serve
twice: the destination's CRC-32 (zip records) is computed over the pieces, and a source
zip record's recorded CRC-32 is checked over the window, so the bytes checked are the
bytes written and the source is read once.

Two details measured on the development VM (docs/benchmarks.md): the buffer is an
anonymous mapping with ``MADV_NOHUGEPAGE`` (copying out of a transparent huge page made
writes 3-6x slower there), and writes to one file take that file's lock (two threads in
``pwrite`` on one file spin on the inode lock), so one thread reads while another writes.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptkit.io.crc import crc32
from ckptkit.io.source import IO_CHUNK, SourceFile, open_source, pread_into, read_fully
from ckptkit.io.spans import RecordCheck, Span

BUFFER = 4 << 20  # bytes per window: one attention head of a 16k-wide model
DENSE = 2  # stream only when it reads at most this many times the bytes it writes
IOV_MAX = 1024
AVAILABLE = hasattr(os, "preadv") and hasattr(os, "pwritev")  # what stream_spans needs

_local = threading.local()


def anonymous(nbytes: int) -> memoryview:
    """A page-aligned anonymous mapping of ``nbytes`` without huge pages."""
    mapped = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapped.madvise(mmap.MADV_NOHUGEPAGE)
    return memoryview(mapped)


def buffer() -> memoryview:
    """This thread's buffer, made once (:func:`anonymous`)."""
    view = getattr(_local, "view", None)
    if view is None or len(view) < BUFFER:
        view = _local.view = anonymous(BUFFER)
    return view


@dataclass
class Window:
    """Source bytes ``lo`` .. ``hi`` of ``path`` and the pieces of it to write, in
    destination order, as absolute source ``(offset, nbytes)``."""

    path: Path
    lo: int
    hi: int
    pieces: list[tuple[int, int]] = field(default_factory=list)
    held: int = 0  # bytes of the pieces
    checks: dict[tuple[int, str], RecordCheck] = field(default_factory=dict)


def windows(spans: list[Span], limit: int | None = None) -> Iterator[Window]:
    """Group ``spans`` (destination order) into windows of at most ``limit`` (default
    :data:`BUFFER`) source bytes: each span joins the current window while the window
    still fits (rows permuted within a head land in one window)."""
    limit = limit or BUFFER
    cur: Window | None = None
    for span in spans:
        pos = 0
        while pos < span.nbytes:
            n = min(span.nbytes - pos, limit)
            off = span.offset + pos
            if cur is not None and (cur.path is span.path or cur.path == span.path):
                lo, hi = min(cur.lo, off), max(cur.hi, off + n)
                if hi - lo <= limit:
                    cur.lo, cur.hi = lo, hi
                    _add(cur, span, off, n)
                    pos += n
                    continue
            if cur is not None:
                yield cur
            cur = Window(span.path, off, off + n)
            _add(cur, span, off, n)
            pos += n
    if cur is not None:
        yield cur


def _add(w: Window, span: Span, off: int, n: int) -> None:
    w.pieces.append((off, n))
    w.held += n
    if span.check is not None:
        w.checks[(id(span.check.verifier), span.check.key)] = span.check


def sparse(spans: list[Span]) -> bool:
    """Whether streaming would read more than :data:`DENSE` times the bytes it writes
    (e.g. a column slice of every row): then a gather from a mapping reads less."""
    held = read = 0
    for w in windows(spans):
        held += w.held
        read += w.hi - w.lo
    return read > DENSE * held


def stream_spans(
    spans: list[Span],
    write: Callable[[list[memoryview], int], object],
    dst_offset: int,
    want_crc: bool = False,
    place: Callable[[int, int], memoryview] | None = None,
) -> int | None:
    """Write the concatenation of ``spans`` from ``dst_offset`` window by window:
    ``write(parts, offset)`` puts each window's pieces (destination order) in place.
    Returns their CRC-32 when ``want_crc``. Source records' CRCs (``Span.check``) are
    checked over the windows that tile them, and any not wholly seen are checked by
    reading them; a mismatch raises (see :class:`~ckptkit.io.records.Verifier`).
    ``place(offset, nbytes)``: where to read a window that is written as it is read (one
    piece) and bound for ``offset``, instead of this thread's buffer (the direct writer's
    staging buffer, :func:`~ckptkit.io.direct.place`, which then needs no copy)."""
    buf = buffer()
    crc = 0
    sources: dict[Path, SourceFile] = {}
    seen: dict[tuple[int, str], RecordCheck] = {}
    try:
        for w in windows(spans):
            if w.path not in sources:
                sources[w.path] = open_source(w.path)
            n = w.hi - w.lo
            view = place(dst_offset, n) if place is not None and len(w.pieces) == 1 else buf[:n]
            read_fully(sources[w.path], view, w.lo)
            for key, check in w.checks.items():
                seen[key] = check
                check.verifier.feed(check, w.lo, view)
            parts = [view[off - w.lo : off - w.lo + n] for off, n in w.pieces]
            if want_crc:
                for part in parts:
                    crc = crc32(part, crc)
            write(parts, dst_offset)
            dst_offset += w.held
    finally:
        for src in sources.values():
            src.close()
    for check in seen.values():
        check.verifier.complete(check)
    return crc if want_crc else None


def crc32_range(fd: int | SourceFile, offset: int, nbytes: int, window: int = BUFFER, crc: int = 0) -> int:
    """CRC-32 of ``nbytes`` of ``fd`` (a descriptor or a source file) from ``offset``
    (continuing ``crc``), read ``window``
    bytes at a time into this thread's reused buffer (bounded memory whatever ``nbytes``)."""
    buf = buffer()[: max(1, min(window, BUFFER))]
    pos, end = offset, offset + nbytes
    while pos < end:
        view = buf[: min(len(buf), end - pos)]
        got = pread_into(fd, view, pos)
        if got == 0:
            raise EOFError(f"source ended {end - pos} bytes early")
        crc = crc32(view[:got], crc)
        pos += got
    return crc


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset``, :data:`IO_CHUNK` bytes per call."""
    write_parts(fd, [data], offset)


def write_parts(fd: int, parts: list[memoryview], offset: int) -> None:
    """Write ``parts`` one after another from ``offset``: ``pwritev`` of at most
    :data:`IOV_MAX` pieces and :data:`IO_CHUNK` bytes per call."""
    batch: list[memoryview] = []
    size = 0
    for part in parts:
        while len(part):
            piece = part[: IO_CHUNK - size]
            batch.append(piece)
            size += len(piece)
            part = part[len(piece) :]
            if size == IO_CHUNK or len(batch) == IOV_MAX:
                _pwritev_all(fd, batch, offset)
                offset, batch, size = offset + size, [], 0
    if batch:
        _pwritev_all(fd, batch, offset)


def _pwritev_all(fd: int, batch: list[memoryview], offset: int) -> None:
    done = os.pwritev(fd, batch, offset)
    pos = 0
    for p in batch:  # a short write: finish piece by piece
        if pos + len(p) > done:
            written = max(0, done - pos)
            while written < len(p):
                written += os.pwrite(fd, p[written:], offset + pos + written)
        pos += len(p)
