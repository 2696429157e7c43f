"""File-to-file copies of byte ranges that never pass through Python, and CRC-32 of a file range.

A tensor whose bytes a conversion does not change is described by a :class:`Span` (which
file, where, how many bytes) and copied into the output at the offset the writer laid out:
``os.copy_file_range`` (the kernel copies, as ``cp`` does), else ``os.sendfile``, else
positioned reads and writes through one bounded buffer. The zip writer's CRC-32 comes from
the source archive where it records one for exactly these bytes, else from ``zlib.crc32``
over a window-by-window mmap of the source: page-cache pages, no user-space copy.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

METHODS = ("copy_file_range", "sendfile", "readwrite")
AUTO = "auto"
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

    ``method`` is ``auto`` (each method in :data:`METHODS` order, falling back when the
    kernel refuses one for these files) or one of them, forced. The ``sendfile`` method
    moves ``dst_fd``'s file position; the others leave it alone. Returns the method that
    finished the copy. Raises OSError for real I/O errors and EOFError when the source
    ends early.
    """
    if method != AUTO and method not in METHODS:
        raise ValueError(f"unknown copy method {method!r}")
    order = METHODS if method == AUTO else (method,)
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
    return os.copy_file_range(src_fd, dst_fd, min(count, CHUNK), src_offset, dst_offset)


def _sendfile(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    os.lseek(dst_fd, dst_offset, os.SEEK_SET)
    return os.sendfile(dst_fd, src_fd, src_offset, min(count, CHUNK))


def _read_write(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
    buf = bytearray(min(count, BUFFER))
    got = os.preadv(src_fd, [buf], src_offset)
    view = memoryview(buf)[:got]
    written = 0
    while written < got:
        written += os.pwrite(dst_fd, view[written:], dst_offset + written)
    return got


_STEPS = {"copy_file_range": _copy_file_range, "sendfile": _sendfile, "readwrite": _read_write}


def copy_span(span: Span, dst_fd: int, dst_offset: int, method: str = AUTO) -> str:
    """Copy a span's bytes into ``dst_fd`` at ``dst_offset``; returns the method used."""
    src_fd = os.open(span.path, os.O_RDONLY)
    try:
        return copy_range(src_fd, span.offset, dst_fd, dst_offset, span.nbytes, method)
    finally:
        os.close(src_fd)


def crc32_range(fd: int, offset: int, nbytes: int, window: int = CRC_WINDOW) -> int:
    """CRC-32 of ``nbytes`` of ``fd`` from ``offset``, read through mmap windows (no copy).

    At most one window is mapped at a time, so the resident memory this adds is bounded by
    ``window`` whatever ``nbytes`` is.
    """
    crc = 0
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


def span_crc32(span: Span) -> int:
    """The CRC-32 of a span's bytes: the one the source records, else computed over mmap."""
    if span.crc is not None:
        return span.crc
    fd = os.open(span.path, os.O_RDONLY)
    try:
        return crc32_range(fd, span.offset, span.nbytes)
    finally:
        os.close(fd)
