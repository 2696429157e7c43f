"""Source files as every reader sees them: a size and positioned reads, wherever the bytes are.

:class:`SourceFile` is the one interface the format readers (safetensors, torch zip,
GGUF, DCP) and the copy engine read through; :func:`open_source` is the one place that
makes one from a path. A path on this disk gives a :class:`LocalFile` (``os.preadv`` on
a descriptor that :meth:`~LocalFile.fileno` hands to the fast local paths: streaming,
``O_DIRECT``, ``copy_file_range``, mappings). Files that are not on this disk (an HTTP
range reader, an in-memory test double) are :func:`mounted` at paths of their own and
stand in for local files there: names under a folder (:func:`entries`), sizes and bytes;
their ``fileno()`` is None, so the copy engine reads them with :meth:`SourceFile.readinto`.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ckptkit.errors import CkptkitError
from ckptkit.untrusted import open_regular

IO_CHUNK = 1 << 20  # bytes per read or write call: larger writes ran 2-3x slower (docs/benchmarks.md)


class SourceFile(Protocol):
    """A source file opened for reading: its size and positioned reads.

    ``fileno()`` is a descriptor of a file on this disk (what the local fast paths use), or
    None for a file elsewhere, read only through :meth:`readinto`.
    """

    path: Path

    def size(self) -> int:
        """The file's length in bytes."""
        ...

    def readinto(self, view: memoryview, offset: int) -> int:
        """Read up to ``len(view)`` bytes at ``offset`` into ``view``; how many (0 at the end)."""
        ...

    def fileno(self) -> int | None:
        """A descriptor of the file on this disk, or None."""
        ...

    def close(self) -> None: ...


class LocalFile:
    """A regular file on this disk (:func:`~ckptkit.untrusted.open_regular`: never a FIFO
    or a device), read with ``preadv``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = open_regular(path)

    def size(self) -> int:
        return os.fstat(self._checked()).st_size

    def readinto(self, view: memoryview, offset: int) -> int:
        return pread_into(self._checked(), view, offset)

    def fileno(self) -> int | None:
        return self._checked()

    def _checked(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: read after close")
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- files that are not on this disk ------------------------------------------------------

_lock = threading.Lock()
_mounted: dict[Path, Callable[[], SourceFile]] = {}  # absolute path -> opener


@contextmanager
def mounted(files: Mapping[Path, Callable[[], SourceFile]]) -> Iterator[None]:
    """Within the block, open each path with its opener instead of from this disk (its folder
    need not exist here); :func:`entries`, :func:`is_file` and :func:`open_source` see it."""
    keys = {p.absolute(): opener for p, opener in files.items()}
    with _lock:
        taken = [str(p) for p in keys if p in _mounted]
        if taken:
            raise ValueError(f"already mounted: {', '.join(taken)}")
        _mounted.update(keys)
    try:
        yield
    finally:
        with _lock:
            for p in keys:
                _mounted.pop(p, None)


def _opener(path: Path) -> Callable[[], SourceFile] | None:
    if not _mounted:  # the usual case: no lookup, no absolute()
        return None
    with _lock:
        return _mounted.get(path.absolute())


def is_local(path: Path) -> bool:
    """Whether ``path`` is read from this disk (not a mounted file)."""
    return _opener(path) is None


def all_local(paths: Iterable[Path]) -> bool:
    """Whether every one of ``paths`` is read from this disk (at once when nothing is mounted)."""
    return not _mounted or all(is_local(p) for p in set(paths))


def open_source(path: Path) -> SourceFile:
    """``path`` opened for reading: the mounted file there, else the local file."""
    opener = _opener(path)
    return LocalFile(path) if opener is None else opener()


def entries(folder: Path) -> list[Path]:
    """The entries of ``folder``: those on this disk and those mounted in it (files, and the
    folders mounted files are in), sorted."""
    found: set[Path] = set()
    if folder.is_dir():
        found.update(folder.iterdir())
    if _mounted:
        where = folder.absolute()
        with _lock:  # the files mounted in it, and the folders they are in
            found.update(folder / p.relative_to(where).parts[0] for p in _mounted if where in p.parents)
    return sorted(found)


def is_file(path: Path) -> bool:
    """Whether ``path`` is a mounted file or a regular file (or a link to one) on this disk."""
    return _opener(path) is not None or path.is_file()


def is_dir(path: Path) -> bool:
    """Whether ``path`` is a folder on this disk or holds mounted files."""
    if path.is_dir():
        return True
    if not _mounted:
        return False
    where = path.absolute()
    with _lock:
        return any(where in p.parents for p in _mounted)


def exists(path: Path) -> bool:
    """Whether ``path`` is a mounted file or folder, or anything on this disk."""
    return is_file(path) or is_dir(path) or path.exists()


def size_of(path: Path) -> int:
    """The size of the file at ``path`` (mounted or local)."""
    if _opener(path) is None:
        return path.stat().st_size
    src = open_source(path)
    try:
        return src.size()
    finally:
        src.close()


# --- reading -------------------------------------------------------------------------------


def pread_into(src: int | SourceFile, view: memoryview, offset: int) -> int:
    """Read up to ``len(view)`` bytes at ``offset`` into ``view``; returns how many. ``src``:
    a descriptor, or a source file (read through its descriptor when it is local)."""
    fd = src if isinstance(src, int) else src.fileno()
    if fd is None:
        return src.readinto(view, offset)  # type: ignore[union-attr]
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def read_fully(src: int | SourceFile, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` of ``src`` (as :func:`pread_into`); EOFError when it ends first."""
    done = 0
    while done < len(view):
        got = pread_into(src, view[done : done + IO_CHUNK], offset + done)
        if got == 0:
            raise EOFError(f"source ended {len(view) - done} bytes early")
        done += got


def read_at(src: SourceFile, offset: int, nbytes: int) -> bytearray:
    """Exactly ``nbytes`` from ``offset``, in a fresh buffer (EOFError when the file ends first)."""
    buf = bytearray(nbytes)
    read_fully(src, memoryview(buf), offset)
    return buf


def read_file(path: Path, limit: int | None = None) -> bytearray:
    """All bytes of the file at ``path``; a one-line error over ``limit`` bytes."""
    src = open_source(path)
    try:
        size = src.size()
        if limit is not None and size > limit:
            raise CkptkitError(f"{path}: larger than {limit >> 20} MiB; refusing to read it whole")
        return read_at(src, 0, size)
    except EOFError:
        raise CkptkitError(f"{path}: changed while it was read (shorter than its size)") from None
    finally:
        src.close()


def copy_file(src: Path, dst: Path) -> None:
    """Copy the bytes of the source file ``src`` to a new local file ``dst`` (its permissions
    from the umask)."""
    source = open_source(src)
    try:
        with open(dst, "xb") as out:
            buf = memoryview(bytearray(min(IO_CHUNK, source.size()) or 1))
            at = 0
            while got := pread_into(source, buf, at):
                out.write(buf[:got])
                at += got
    finally:
        source.close()


class Window(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of a source file as a seekable binary file of their
    own (for ``zipfile``, ``pickle``, sequential header parsers); closing it leaves ``src`` open."""

    def __init__(self, src: SourceFile, offset: int = 0, length: int | None = None) -> None:
        self.src, self._base, self._pos = src, offset, 0
        self._len = src.size() - offset if length is None else length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._len}[whence] + pos
        if self._pos < 0:
            raise ValueError("negative seek position")
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._len - self._pos))
        got = self.src.readinto(view[:n], self._base + self._pos) if n else 0
        self._pos += got
        return got
