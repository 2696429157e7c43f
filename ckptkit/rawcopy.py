"""File-to-file copies of byte ranges that never pass through Python, and CRC-32 of file ranges.

A tensor whose bytes a conversion only moves is described by a list of :class:`Span`
(which file, where, how many bytes; concatenated in order): one span when it is stored
unchanged, row ranges when rows are permuted, split or joined. The list is written at the
offset the writer laid out: each span with ``os.copy_file_range`` (the kernel copies, as
``cp`` does), else ``os.sendfile``, else positioned reads and writes through one bounded
buffer; many small spans at once with one ``pwritev`` gathering from a read-only mapping
of the source ("gather"). The zip writer's CRC-32 comes from the source archive where it
records one for exactly these bytes, else from ``zlib.crc32`` over window-by-window mmaps
of the source: page-cache pages, no user-space copy.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

RANGE_METHODS = ("copy_file_range", "sendfile", "readwrite")  # for one range, in auto's order
GATHER = "gather"
METHODS = (*RANGE_METHODS, GATHER)
AUTO = "auto"
GATHER_FROM = 16  # auto: a list of at least this many spans is gathered with pwritev
CHUNK = 1 << 30  # bytes per copy_file_range / sendfile call
BUFFER = 8 << 20  # the read/write fallback's buffer
CRC_WINDOW = 64 << 20  # bytes mapped at a time while computing a CRC
# errors that mean "this method does not work for these two files", not "the copy failed"
_UNSUPPORTED = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EPERM}


@dataclass(frozen=True)
class Span:
    """``nbytes`` bytes of ``path`` from ``offset``: where one tensor's data lies.

    ``crc`` is the CRC-32 of exactly these bytes when the source file records it (a zip
    record holding the whole tensor), else None.
    """

    path: Path
    offset: int
    nbytes: int
    crc: int | None = None

    def slice(self, start: int, nbytes: int) -> Span:
        """The sub-span of ``nbytes`` bytes from ``start`` within this one (no CRC unless whole)."""
        if start < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"slice {start}+{nbytes} outside a span of {self.nbytes} bytes")
        if start == 0 and nbytes == self.nbytes:
            return self
        return replace(self, offset=self.offset + start, nbytes=nbytes, crc=None)


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int, method: str = AUTO) -> str:
    """Copy ``nbytes`` from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset``.

    ``method`` is ``auto`` (each method in :data:`RANGE_METHODS` order, falling back when the
    kernel refuses one for these files) or one of them, forced. The ``sendfile`` method
    moves ``dst_fd``'s file position; the others leave it alone. Returns the method that
    finished the copy. Raises OSError for real I/O errors and EOFError when the source
    ends early.
    """
    if method != AUTO and method not in RANGE_METHODS:
        raise ValueError(f"not a method for one range: {method!r}")
    order = RANGE_METHODS if method == AUTO else (method,)
    done = 0
    for i, name in enumerate(order):
        step = _STEPS[name]
        try:
            while done < nbytes:
                n = step(src_fd, src_offset + done, dst_fd, dst_offset + done, nbytes - done)
                if n == 0:
                    raise EOFError(f"source ended {nbytes - done} bytes early")
                done += n
            return name
        except OSError as e:
            if e.errno not in _UNSUPPORTED or i == len(order) - 1:
                raise
    return order[-1]  # nbytes == 0


def _copy_file_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    if not hasattr(os, "copy_file_range"):  # not Linux
        raise OSError(errno.ENOSYS, "copy_file_range is not available")
    return os.copy_file_range(src_fd, dst_fd, min(count, CHUNK), src_offset, dst_offset)


def _sendfile(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    if not sys.platform.startswith("linux"):  # elsewhere sendfile writes to sockets only
        raise OSError(errno.ENOSYS, "sendfile to a file needs Linux")
    os.lseek(dst_fd, dst_offset, os.SEEK_SET)
    return os.sendfile(dst_fd, src_fd, src_offset, min(count, CHUNK))


def _read_write(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    buf = bytearray(min(count, BUFFER))
    if hasattr(os, "preadv"):
        got = os.preadv(src_fd, [buf], src_offset)
    else:
        data = os.pread(src_fd, len(buf), src_offset)
        got = len(data)
        buf[:got] = data
    view = memoryview(buf)[:got]
    written = 0
    while written < got:
        written += os.pwrite(dst_fd, view[written:], dst_offset + written)
    return got


_STEPS = {"copy_file_range": _copy_file_range, "sendfile": _sendfile, "readwrite": _read_write}


def coalesce(spans: list[Span]) -> list[Span]:
    """The same bytes in as few spans as possible (neighbours in one file merged)."""
    out: list[Span] = []
    for span in spans:
        if span.nbytes == 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.path == span.path and last.offset + last.nbytes == span.offset:
            out[-1] = Span(last.path, last.offset, last.nbytes + span.nbytes)
        else:
            out.append(span)
    return out


def take_ranges(spans: list[Span], ranges: Iterable[tuple[int, int]]) -> list[Span]:
    """The byte ranges ``(start, nbytes)``, in order, of the concatenation of ``spans``."""
    starts = list(itertools.accumulate((s.nbytes for s in spans), initial=0))
    out: list[Span] = []
    for start, nbytes in ranges:
        end = start + nbytes
        if start < 0 or end > starts[-1]:
            raise ValueError(f"bytes {start}..{end} outside spans of {starts[-1]} bytes")
        i = bisect.bisect_right(starts, start) - 1
        while start < end:
            piece = min(end, starts[i + 1]) - start
            out.append(spans[i].slice(start - starts[i], piece))
            start += piece
            i += 1
    return out


def take(spans: list[Span], start: int, nbytes: int) -> list[Span]:
    """Bytes ``start`` .. ``start + nbytes`` of the concatenation of ``spans``."""
    return take_ranges(spans, [(start, nbytes)])


def take_rows(spans: list[Span], row_bytes: int, rows: list[int]) -> list[Span]:
    """The rows ``rows`` (in that order) of a row-major tensor whose bytes are ``spans``."""
    return coalesce(take_ranges(spans, ((r * row_bytes, row_bytes) for r in rows)))


def read_spans(spans: list[Span]) -> bytes:
    """The bytes of ``spans``, read into memory (for small tensors)."""
    out = bytearray()
    for span in spans:
        with span.path.open("rb") as f:
            f.seek(span.offset)
            data = f.read(span.nbytes)
        if len(data) != span.nbytes:
            raise EOFError(f"{span.path}: ends inside bytes {span.offset}..{span.offset + span.nbytes}")
        out += data
    return bytes(out)


def total_bytes(spans: list[Span]) -> int:
    return sum(s.nbytes for s in spans)


def copy_spans(spans: list[Span], dst_fd: int, dst_offset: int, method: str = AUTO) -> str:
    """Write the concatenation of ``spans`` into ``dst_fd`` at ``dst_offset``.

    ``auto`` gathers a long list (many small row ranges) with ``pwritev`` and copies a
    short one span by span (:func:`copy_range`); a forced method applies to every span.
    Returns the method used ("auto" never).
    """
    spans = coalesce(spans)
    if method == GATHER or (method == AUTO and len(spans) >= GATHER_FROM and hasattr(os, "pwritev")):
        _gather(spans, dst_fd, dst_offset)
        return GATHER
    used = method if method != AUTO else RANGE_METHODS[0]
    fds: dict[Path, int] = {}
    try:
        for span in spans:
            if span.path not in fds:
                fds[span.path] = os.open(span.path, os.O_RDONLY)
            used = copy_range(fds[span.path], span.offset, dst_fd, dst_offset, span.nbytes, method)
            dst_offset += span.nbytes
    finally:
        for fd in fds.values():
            os.close(fd)
    return used


IOV_MAX = 1024  # buffers per pwritev call (Linux's limit)


class _Mapped:
    """Read-only mappings of the extents of ``spans`` (one per file) and a view per span.

    ``release()`` hands the pages touched so far back (they are page cache: touching
    them again is a minor fault), so resident memory stays at one batch of views.
    """

    def __init__(self, spans: list[Span]) -> None:
        gran = mmap.ALLOCATIONGRANULARITY
        self._maps: dict[Path, tuple[mmap.mmap, memoryview, int]] = {}
        self.views: list[memoryview] = []
        try:
            for path in dict.fromkeys(s.path for s in spans):
                mine = [s for s in spans if s.path == path]
                lo = min(s.offset for s in mine)
                base = lo - lo % gran
                fd = os.open(path, os.O_RDONLY)
                try:
                    mapped = mmap.mmap(
                        fd, max(s.offset + s.nbytes for s in mine) - base, access=mmap.ACCESS_READ, offset=base
                    )
                finally:
                    os.close(fd)
                self._maps[path] = (mapped, memoryview(mapped), base)
            for s in spans:
                _, view, base = self._maps[s.path]
                self.views.append(view[s.offset - base : s.offset - base + s.nbytes])
        except BaseException:
            self.close()
            raise

    def release(self) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped, _, _ in self._maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        for v in self.views:
            v.release()
        for mapped, view, _ in self._maps.values():
            view.release()
            mapped.close()
        self.views, self._maps = [], {}

    def __enter__(self) -> _Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gather(spans: list[Span], dst_fd: int, dst_offset: int) -> None:
    """``pwritev`` of slices of read-only mappings of the source: the kernel copies from
    the page cache to the file, a batch of at most IOV_MAX spans at a time."""
    with _Mapped(spans) as mapped:
        views = mapped.views
        for i in range(0, len(views), IOV_MAX):
            batch = views[i : i + IOV_MAX]
            want = sum(len(v) for v in batch)
            done = os.pwritev(dst_fd, batch, dst_offset)
            if done != want:  # a short write: finish this batch piece by piece
                _finish_short(batch, done, dst_fd, dst_offset)
            dst_offset += want
            mapped.release()


def _finish_short(batch: list[memoryview], done: int, dst_fd: int, dst_offset: int) -> None:
    pos = 0
    for v in batch:
        if pos + len(v) > done:
            written = max(0, done - pos)
            while written < len(v):
                written += os.pwrite(dst_fd, v[written:], dst_offset + pos + written)
        pos += len(v)


def crc32_range(fd: int, offset: int, nbytes: int, window: int = CRC_WINDOW, crc: int = 0) -> int:
    """CRC-32 of ``nbytes`` of ``fd`` from ``offset`` (continuing ``crc``), read through
    mmap windows (no copy).

    At most one window is mapped at a time, so the resident memory this adds is bounded by
    ``window`` whatever ``nbytes`` is.
    """
    pos, end = offset, offset + nbytes
    gran = mmap.ALLOCATIONGRANULARITY
    while pos < end:
        base = pos - pos % gran
        length = min(end, pos + window) - base
        with mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=base) as mapped:
            with memoryview(mapped) as view:
                crc = zlib.crc32(view[pos - base :], crc)
        pos = base + length
    return crc


def spans_crc32(spans: list[Span]) -> int:
    """The CRC-32 of the concatenation of ``spans``: the one the source records for a
    single whole span, else computed over mappings of the source (windowed for a few long
    spans, batched for many short ones)."""
    if len(spans) == 1 and spans[0].crc is not None:
        return spans[0].crc
    spans = coalesce(spans)
    crc = 0
    if len(spans) >= GATHER_FROM:
        with _Mapped(spans) as mapped:
            for i, view in enumerate(mapped.views, start=1):
                crc = zlib.crc32(view, crc)
                if i % IOV_MAX == 0:
                    mapped.release()
        return crc
    for span in spans:
        fd = os.open(span.path, os.O_RDONLY)
        try:
            crc = crc32_range(fd, span.offset, span.nbytes, crc=crc)
        finally:
            os.close(fd)
    return crc
