"""File-to-file copies of span lists that never become Python objects, and the output file
they go to.

:func:`transfer` writes the concatenation of a tensor's :class:`~ckptkit.io.spans.Span`
list at the offset the writer laid out. It streams (:mod:`ckptkit.io.stream`: each window
of source bytes read once into a small reused buffer, CRC-32s computed or checked there,
written out), the whole pages past the page cache for a large output or on request
(:mod:`ckptkit.io.direct`). Users choose among :data:`COPY_METHODS` only; the other
methods are fallbacks :func:`transfer` picks by itself, logged on the ``ckptkit.io``
logger: spans so scattered that streaming would read more than twice what it writes are
gathered with ``pwritev`` from a read-only mapping of the source (``gather``), and where
``preadv``/``pwritev`` are missing each span goes with ``os.copy_file_range`` (the kernel
copies, as ``cp`` does), else ``os.sendfile``, else positioned reads and writes. Spans of
a zip record carry a :class:`~ckptkit.io.spans.RecordCheck`: before its bytes are used,
the record's recorded CRC-32 is checked once per file
(:class:`~ckptkit.io.records.Verifier`), by the stream pass itself where it reads the
whole record in order, else by reading the record.

:class:`OutputFile` is one output file as a format writer sees it: bytes in memory and
span lists written at offsets, one writer at a time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.io import direct as directio
from ckptkit.io import stream
from ckptkit.io.crc import crc32
from ckptkit.io.records import verify_checks
from ckptkit.io.source import SourceFile, all_local, open_source
from ckptkit.io.spans import Span, coalesce, total_bytes
from ckptkit.io.stream import crc32_range

log = logging.getLogger(__name__)

AUTO = "auto"
DIRECT = "direct"  # stream, the whole pages written past the page cache (ckptkit.io.direct)
STREAM = "stream"  # stream, every write through the page cache
COPY_METHODS = (AUTO, DIRECT, STREAM)  # what a user may choose (--copy-method, convert())
# the fallbacks transfer() picks by itself; tests may force them
RANGE_METHODS = ("copy_file_range", "sendfile", "readwrite")  # for one range, in fallback order
GATHER = "gather"
METHODS = (DIRECT, STREAM, *RANGE_METHODS, GATHER)  # every method transfer() can be forced to use
GATHER_FROM = 16  # spans_crc32: at least this many spans are read through one mapping
CHUNK = 1 << 30  # bytes per copy_file_range / sendfile call
BUFFER = stream.BUFFER  # the read/write fallback's buffer (the stream buffer)
# errors that mean "this method does not work for these two files", not "the copy failed"
_UNSUPPORTED = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EPERM}


def copy_range(
    src: int | SourceFile, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int, method: str = AUTO
) -> str:
    """Copy ``nbytes`` from ``src`` (a descriptor, or a source file: ``readwrite`` only
    unless it is local) at ``src_offset`` to ``dst_fd`` at ``dst_offset``.

    ``method`` is ``auto`` (each method in :data:`RANGE_METHODS` order, falling back when the
    kernel refuses one for these files) or one of them, forced. The ``sendfile`` method
    moves ``dst_fd``'s file position; the others leave it alone. Returns the method that
    finished the copy. Raises OSError for real I/O errors and EOFError when the source
    ends early.
    """
    if method != AUTO and method not in RANGE_METHODS:
        raise ValueError(f"not a method for one range: {method!r}")
    order = RANGE_METHODS if method == AUTO else (method,)
    src_fd = src if isinstance(src, int) else src.fileno()
    if src_fd is None:  # not on this disk: read and written
        order = ("readwrite",)
    done = 0
    for i, name in enumerate(order):
        step = _STEPS[name]
        try:
            while done < nbytes:
                n = step(src if src_fd is None else src_fd, src_offset + done, dst_fd, dst_offset + done, nbytes - done)
                if n == 0:
                    raise EOFError(f"source ended {nbytes - done} bytes early")
                done += n
            return name
        except OSError as e:
            if e.errno not in _UNSUPPORTED or i == len(order) - 1:
                raise
            log.debug("%s refused for these files (%s): falling back to %s", name, e.strerror, order[i + 1])
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


def _read_write(src_fd: int | SourceFile, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    view = stream.buffer()[: min(count, BUFFER)]
    got = stream.pread_into(src_fd, view, src_offset)
    stream.write_all(dst_fd, view[:got], dst_offset)
    return got


_STEPS: dict[str, Callable[[Any, int, int, int, int], int]] = {
    "copy_file_range": _copy_file_range,
    "sendfile": _sendfile,
    "readwrite": _read_write,
}


@dataclass(frozen=True)
class Transfer:
    method: str  # the method that wrote the bytes
    crc: int | None  # CRC-32 of the bytes written, when asked for


def transfer(
    spans: list[Span],
    dst_fd: int,
    dst_offset: int,
    method: str = AUTO,
    want_crc: bool = False,
    lock: threading.Lock | None = None,
    direct: directio.DirectFd | None = None,
) -> Transfer:
    """Write the concatenation of ``spans`` into ``dst_fd`` at ``dst_offset``, checking the
    source records they draw on first (or on the way, for ``stream`` and ``direct``).

    ``auto`` streams (:mod:`ckptkit.io.stream`), writing whole pages with ``direct``'s
    ``O_DIRECT`` descriptor (:mod:`ckptkit.io.direct`) when it is given and ``direct.auto``,
    unless the spans are many scattered pieces (a column slice of every row), which it
    gathers with ``pwritev`` from a mapping; without ``preadv``/``pwritev``, each span goes
    with the first of :data:`RANGE_METHODS` the kernel takes. A forced method (any of
    :data:`METHODS`; users force only ``direct`` or ``stream``) applies to every span
    (``direct`` reports ``stream`` where no window had whole pages to write direct, or the
    file refused). ``want_crc``: also return the CRC-32 of the bytes written. ``lock``:
    held while writing to the file (one writer per file at a time). Writeback of the range
    is started on the way out (:func:`start_writeback`).
    """
    spans = coalesce(spans)
    nbytes = total_bytes(spans)
    local = all_local(s.path for s in spans)
    if not local and method in (GATHER, *RANGE_METHODS):  # they need descriptors of local files
        log.debug("%s needs local files: %d bytes not on this disk streamed", method, nbytes)
        method = STREAM if stream.AVAILABLE else "readwrite"
    if method == AUTO and stream.AVAILABLE:  # else (no preadv/pwritev): the range methods
        dense = DIRECT if direct is not None and direct.auto else STREAM
        method = GATHER if local and stream.sparse(spans) else dense
        if method == GATHER:
            log.debug("%d bytes in %d scattered spans: gathered from a mapping", nbytes, len(spans))
    elif method == AUTO:
        log.debug("no preadv/pwritev here: %d bytes copied range by range", nbytes)
    if method in (STREAM, DIRECT):
        used = STREAM

        def write(parts: list[memoryview], at: int) -> None:
            nonlocal used
            if method == DIRECT and direct is not None:
                if directio.write_parts(dst_fd, direct, parts, at, lock):
                    used = DIRECT
                return
            with lock or nullcontext():
                stream.write_parts(dst_fd, parts, at)

        place = directio.place if method == DIRECT and direct is not None else None
        crc = stream.stream_spans(spans, write, dst_offset, want_crc, place)
        start_writeback(dst_fd, dst_offset, nbytes)
        return Transfer(used, crc)
    verify_checks(spans)
    if method == GATHER:
        _gather(spans, dst_fd, dst_offset)
        used = GATHER
    else:  # one range method, or auto's fallback order
        if method == AUTO and not local:
            method = "readwrite"
        used = RANGE_METHODS[0] if method == AUTO else method
        sources: dict[Path, SourceFile] = {}
        try:
            at = dst_offset
            for span in spans:
                if span.path not in sources:
                    sources[span.path] = open_source(span.path)
                used = copy_range(sources[span.path], span.offset, dst_fd, at, span.nbytes, method)
                at += span.nbytes
        finally:
            for src in sources.values():
                src.close()
    start_writeback(dst_fd, dst_offset, nbytes)
    return Transfer(used, spans_crc32(spans) if want_crc else None)


def copy_spans(spans: list[Span], dst_fd: int, dst_offset: int, method: str = AUTO) -> str:
    """:func:`transfer` without a CRC; returns the method used ("auto" never)."""
    return transfer(spans, dst_fd, dst_offset, method).method


class OutputFile:
    """One output file, created and sized by its format writer, as the writer fills it:
    bytes in memory (:meth:`write`) and span lists (:meth:`copy`) put at offsets, from any
    thread, one writer at a time (the file's lock: see :func:`ckptkit.io.direct.write_parts`
    for why), with writeback started as each range is done.

    ``direct``: whether ``auto`` copies write whole pages past the page cache
    (:func:`ckptkit.io.direct.direct_pays` for the whole output); ``direct`` copies always do.
    """

    def __init__(self, path: Path, direct: bool = False) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        self._lock = threading.Lock()
        self._direct = directio.DirectFd(path, auto=direct)  # O_DIRECT, opened on first use

    def write(self, data: bytes | memoryview, offset: int, writeback: bool = True) -> None:
        """Write all of ``data`` at ``offset``; ``writeback``: start writing it to disk now
        (not worth it for a few bytes patched into a page written again later). Where the
        file was opened ``direct`` (the output is past the dirty limit), the whole pages of
        a large write go past the page cache (:func:`ckptkit.io.direct.write_parts`)."""
        view = memoryview(data).cast("B")
        if self._direct.auto and view.nbytes >= directio.MIN_DIRECT:
            for at in range(0, view.nbytes, stream.BUFFER):
                directio.write_parts(self._fd, self._direct, [view[at : at + stream.BUFFER]], offset + at, self._lock)
        else:
            with self._lock:
                stream.write_all(self._fd, view, offset)
        if writeback:
            start_writeback(self._fd, offset, view.nbytes)

    def copy(self, spans: list[Span], offset: int, method: str = AUTO, want_crc: bool = False) -> Transfer:
        """Copy the concatenation of ``spans`` to ``offset`` file to file (:func:`transfer`);
        returns the method used and, with ``want_crc``, the CRC-32 of the bytes written."""
        fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))  # its own file position, for sendfile
        try:
            done = transfer(spans, fd, offset, method, want_crc, self._lock, self._direct)
        finally:
            os.close(fd)
        log.debug("%s: %d bytes at %d by %s", self.path.name, total_bytes(spans), offset, done.method)
        return done

    def close(self) -> None:
        """Close the file's descriptors (again: a no-op)."""
        self._direct.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these bytes to disk now, without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the fsync before publishing finds
    little left to do. Best effort: a no-op where unavailable or refused."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


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
    the page cache to the file, the mapped pages released every ``IOV_MAX`` spans."""
    with _Mapped(spans) as mapped:
        views = mapped.views
        for i in range(0, len(views), stream.IOV_MAX):
            batch = views[i : i + stream.IOV_MAX]
            stream.write_parts(dst_fd, batch, dst_offset)
            dst_offset += sum(len(v) for v in batch)
            mapped.release()


def spans_crc32(spans: list[Span]) -> int:
    """The CRC-32 of the concatenation of ``spans``: the one the source records for a
    single whole span, else computed over mappings of the source (windowed for a few long
    spans, batched for many short ones)."""
    if len(spans) == 1 and spans[0].crc is not None:
        return spans[0].crc
    spans = coalesce(spans)
    crc = 0
    if len(spans) >= GATHER_FROM and all_local(s.path for s in spans):
        with _Mapped(spans) as mapped:
            for i, view in enumerate(mapped.views, start=1):
                crc = crc32(view, crc)
                if i % stream.IOV_MAX == 0:
                    mapped.release()
        return crc
    for span in spans:
        src = open_source(span.path)
        try:
            crc = crc32_range(src, span.offset, span.nbytes, crc=crc)
        finally:
            src.close()
    return crc
