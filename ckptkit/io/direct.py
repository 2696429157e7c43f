"""Writes that bypass the page cache (``O_DIRECT``) for the page-aligned bulk of a range.

A conversion writes each output byte once and does not read it back, yet a buffered
write copies it into freshly allocated page cache, which the kernel must later write out
and reclaim. For a checkpoint larger than a few GB that allocation and reclaim is most of
the cost (``docs/benchmarks.md``: ``dd oflag=direct`` of 13.5 GB took half the time of
``cp`` and a ninth of its system time on the development VM). So the bytes of a
destination range are laid out in an aligned staging buffer and the whole pages inside
the range go to the file with ``O_DIRECT``; the partial pages at either end (shared with
a neighbouring tensor or a header) go through the page cache, and one writer at a time
holds the file (see :func:`write_parts` for why), which keeps the two paths coherent;
``fsync`` before publishing flushes both.

ckptkit publishes only what is on disk (it fsyncs before the rename), so a conversion
waits for the disk either way, and a buffered write adds the page cache's allocation and
copy on top. Past the kernel's dirty limit (:func:`dirty_limit`, 20 % of available memory
by default) the buffered writer is also throttled to the disk's pace, and direct pays
(13.5 GB meta>hf on the development VM: 16.7 s buffered, 11.7 s direct, with 14.4 and
3.6 s of system time). Under it the two cost about the same, and which wins depends on
the VM's page-cache mode (2.1 GB meta>hf, 5 interleaved rounds: 1.88 s buffered, 2.08 s
direct; in runs where ``cp`` was slow, direct won), while buffered output stays cached
for whatever reads it next (docs/benchmarks.md). So ``auto`` writes direct only above the
limit (:func:`direct_pays`); ``--copy-method direct`` forces it.

Bytes made in memory a piece at a time (dequantized weights) are the exception: there is no
source page to copy from, so a buffered write is one more copy into newly allocated page
cache, and the pieces are placed in memory as their pages lie in the file, so a direct
write takes them where they are. On the development VM a buffered write of 0.25-3.3 GiB
from memory cost 1.1-2.0 CPU seconds per GiB, direct 0.05-0.1, the wall time 3-4x less
(``bench/quant.py``'s FP8 -> bf16 of 3.3 GiB: 11.0 s buffered, 8.0 s direct, then). So
``auto`` also writes direct when :data:`MADE_DIRECT` bytes or more of the output are made so.

Where the filesystem refuses ``O_DIRECT`` (``open`` or a write fails with ``EINVAL``),
the same bytes are written buffered instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from contextlib import nullcontext
from pathlib import Path

from ckptkit.io import stream

ALIGN = 4096  # offset, length and memory alignment of a direct write (any device's logical block)
MIN_DIRECT = 64 << 10  # whole-page runs shorter than this go buffered: not worth a device round trip
MADE_DIRECT = 256 << 20  # bytes made in memory a piece at a time past which auto writes direct
AVAILABLE = hasattr(os, "O_DIRECT")
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
log = logging.getLogger(__name__)

_local = threading.local()


def dirty_limit() -> int | None:
    """Bytes of dirty page cache past which the kernel throttles a writer (``vm.dirty_bytes``,
    else ``vm.dirty_ratio`` percent of available memory); None where unknown (not Linux)."""
    try:
        vm = Path("/proc/sys/vm")
        dirty_bytes = int((vm / "dirty_bytes").read_text())
        if dirty_bytes > 0:
            return dirty_bytes
        ratio = int((vm / "dirty_ratio").read_text())
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 * ratio // 100
    except (OSError, ValueError, IndexError):
        pass
    return None


def direct_pays(nbytes: int, made: int = 0) -> bool:
    """Whether ``auto`` should write an output of ``nbytes`` direct: when it exceeds the
    kernel's dirty limit, or when ``made`` of its bytes, :data:`MADE_DIRECT` or more, are made
    in memory a piece at a time (see the module docstring)."""
    limit = dirty_limit()
    pays = AVAILABLE and (made >= MADE_DIRECT or limit is not None and nbytes > limit)
    log.info(
        "output of %d bytes (%d made a piece at a time), dirty limit %s: auto writes %s",
        nbytes,
        made,
        "unknown" if limit is None else f"{limit} bytes",
        "whole pages direct (O_DIRECT)" if pays else "through the page cache",
    )
    return pays


def open_direct(path: Path) -> int | None:
    """A write-only descriptor of ``path`` with ``O_DIRECT``, or None where the platform or
    the filesystem has none (tmpfs before Linux 6.6, some FUSE filesystems)."""
    if not AVAILABLE:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in _REFUSED:
            log.info("%s: the filesystem refuses O_DIRECT (%s): writing it buffered", path, e.strerror)
            return None
        raise


def staging() -> memoryview:
    """This thread's staging buffer: page-aligned, one stream window plus a page
    (:func:`~ckptkit.io.stream.anonymous`)."""
    view = getattr(_local, "view", None)
    if view is None or len(view) < stream.BUFFER + ALIGN:
        view = _local.view = stream.anonymous(stream.BUFFER + ALIGN)
    return view


def place(offset: int, nbytes: int) -> memoryview:
    """Where to read ``nbytes`` bound for file ``offset`` so that :func:`write_parts` finds
    them in place and skips its copy into the staging buffer: this thread's buffer, at the
    offset's position within its page (any writable buffer whose address is so placed is
    written from where it lies). At most :data:`~ckptkit.io.stream.BUFFER` bytes."""
    lead = offset % ALIGN
    return staging()[lead : lead + nbytes]


def _address(view: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or empty: not the staging buffer
        return None


def write_parts(
    fd: int, direct: DirectFd, parts: list[memoryview], offset: int, lock: threading.Lock | None = None
) -> bool:
    """Write ``parts`` one after another from ``offset``: the whole pages in between with
    ``direct``'s descriptor, the partial pages at the ends with ``fd``, all while holding
    ``lock``. At most :data:`~ckptkit.io.stream.BUFFER` bytes. Returns whether any byte
    went direct (False: all buffered, because the run was short or the file refuses).

    The lock is the file's (one writer at a time, buffered or direct): a direct write
    flushes and drops the cached pages it overlaps, which is only safe if no buffered
    write dirties them meanwhile; where the kernel's page or folio is larger than
    :data:`ALIGN` (64 KiB pages, large folios) a buffered edge and a direct page can share
    one, so the writes to a file must not overlap in time.
    """
    total = sum(len(p) for p in parts)
    head = min(total, -offset % ALIGN)  # bytes before the first page boundary
    body = (total - head) // ALIGN * ALIGN
    if body < MIN_DIRECT or total > stream.BUFFER:
        with lock or nullcontext():
            stream.write_parts(fd, parts, offset)
        return False
    lead = offset % ALIGN  # the range starts this far into its first page
    address = _address(parts[0]) if len(parts) == 1 else None
    if address is not None and address % ALIGN == lead:
        # laid out in memory as the pages are in the file (read in place into the staging
        # buffer, or a caller's buffer placed so: GGUF chunks): written from where it lies
        buf, lo = parts[0], 0
    else:
        buf, lo = staging(), lead  # this thread's: filled before taking the lock
        pos = lead
        for part in parts:
            buf[pos : pos + len(part)] = part
            pos += len(part)
    start = lo + head  # the first whole page, aligned in memory and in the file
    edges = [(buf[lo:start], offset), (buf[start + body : lo + total], offset + head + body)]
    with lock or nullcontext():
        for data, at in edges:
            if len(data):
                stream.write_all(fd, data, at)
        done = _write_direct(direct, buf[start : start + body], offset + head)
        if done < body:  # refused, or stopped off a page boundary: the rest buffered
            stream.write_all(fd, buf[start + done : start + body], offset + head + done)
    return done > 0


def _write_direct(direct: DirectFd, data: memoryview, offset: int) -> int:
    """Write ``data`` with ``direct``'s descriptor while it takes whole pages; returns the
    bytes written. A refusal (``EINVAL``...) is remembered: the file goes buffered from then on."""
    direct_fd = direct.get()
    done = 0
    try:
        while direct_fd is not None and done < len(data):
            n = os.pwrite(direct_fd, data[done:], offset + done)
            done += max(n, 0)
            if n <= 0 or n % ALIGN:
                break
    except OSError as e:
        if e.errno not in _REFUSED:
            raise
        log.info("%s: an O_DIRECT write was refused (%s): writing it buffered", direct.path, e.strerror)
        direct.close()  # never tried again: the file goes buffered
    return done


class DirectFd:
    """One output file's ``O_DIRECT`` descriptor, opened on first use and shared by the
    threads writing the file (``pwrite`` needs no file position); None where the file
    system refuses it, at open or at a first write. ``auto``: whether ``auto`` copies use
    it (:func:`direct_pays` for the whole output); ``direct`` copies always do."""

    def __init__(self, path: Path, auto: bool = False) -> None:
        self.path = path
        self.auto = auto
        self._fd: int | None = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> int | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._fd = open_direct(self.path)
            return self._fd

    def close(self) -> None:
        with self._lock:
            self._tried = True
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None
