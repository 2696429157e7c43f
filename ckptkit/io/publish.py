"""The one way ckptkit puts a checkpoint folder in place: complete, or not at all.

``with publishing(dst, replace=...) as tmp:`` yields a fresh folder beside ``dst`` to
write into. On success every file and folder in it is fsynced, then it takes ``dst``'s
place: with one ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it (a reader
sees the old or the new folder, never neither), else by renaming the old ``dst`` aside,
the new one in, and deleting the old. On any failure the temporary folder goes away and
``dst`` is as it was; OS errors become one line naming ``dst`` and the cause.

A lock file beside ``dst`` (``flock``, released by the kernel when its holder dies)
makes a second writer to the same ``dst`` fail at once. Whoever holds the lock removes
the temporary and set-aside folders that killed writers left beside ``dst``
(:func:`sweep` does the same for a whole folder, e.g. a trainer's ``output_dir``).

SIGTERM and SIGHUP stop a writer as Ctrl-C does (:func:`stopping_on_signals`): all three
raise :class:`Stopped`, a KeyboardInterrupt, where the process is, so every ``with publishing``
block on the way out removes its temporary folder and lock. SIGKILL cannot be caught: the
next writer cleans up.

Each step calls ``sys.audit("ckptkit.publish", step, path)`` first, so a test can stop
the process at any of them (an audit hook sending itself SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from ckptkit.errors import CkptkitError, WriteError

TMP_SUFFIX = ".ckptkit-tmp"  # a folder being written
OLD_SUFFIX = ".ckptkit-old"  # a replaced folder waiting to be deleted
LOCK_SUFFIX = ".ckptkit-lock"
# ".NAME.PID-RANDOM.ckptkit-tmp"; before 0.2: ".NAME.RANDOM.ckptkit-tmp" (mkdtemp) and the
# trainer's ".NAME.partial-PID" / ".NAME.old-PID".
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:[\w-]+\.ckptkit-(?:tmp|old)|partial-\d+|old-\d+)")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _audit(step: str, path: Path) -> None:
    sys.audit("ckptkit.publish", step, str(path))


def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_EXCHANGE = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the OS or filesystem cannot."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (folders after their contents)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name, os.O_RDONLY)
        _fsync(Path(folder), os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# --- stopping signals ---------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []  # the stop signal received in the current stopping_on_signals block


class Stopped(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP received: raised where the process was, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(stop: KeyboardInterrupt) -> int:
    """The signal behind ``stop``: SIGINT for a plain KeyboardInterrupt (Ctrl-C)."""
    return stop.signum if isinstance(stop, Stopped) else signal.SIGINT


def stopped_by() -> int | None:
    """The stop signal received in the current :func:`stopping_on_signals` block, if any:
    an error raised after it (a peer process that stopped too) is part of that stop."""
    return _received[-1] if _received else None


def _stop(signum: int, frame: object) -> None:
    for s in STOP_SIGNALS:  # one stop: the clean-up it starts is not itself stopped
        signal.signal(s, signal.SIG_IGN)
    _received.append(signum)
    raise Stopped(signum)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """While in the block, Ctrl-C, SIGTERM and SIGHUP raise :class:`Stopped` (after the
    first, all three are ignored until the block ends: the clean-up runs to its end); the
    handlers before are restored after it. Outside the main thread (where Python cannot
    set handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        _received.clear()


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Stop signals arriving in the block are delivered after it: what it does is done whole."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# --- the lock ------------------------------------------------------------------------


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}{LOCK_SUFFIX}"


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created if needed), or None if held."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:  # the holder before us may have unlinked it: lock the file that is there now
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


@contextlib.contextmanager
def locked(dst: Path) -> Iterator[None]:
    """Hold ``dst``'s writer lock; a one-line error if another process holds it."""
    path = lock_path(dst)
    fd = _try_lock(path)
    if fd is None:
        raise CkptkitError(
            f"{dst}: another ckptkit process is writing it{_holder(path)}; wait for it to finish or choose another DST"
        )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _clean_leftovers(dst)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still locked: a waiting process re-checks the inode
        os.close(fd)


# --- leftovers of killed writers ---------------------------------------------------------


def leftovers(parent: Path, name: str | None = None) -> list[Path]:
    """Temporary and set-aside folders beside ``parent/name`` (any name when None)."""
    try:
        entries = sorted(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for p in entries:
        m = _LEFTOVER.fullmatch(p.name)
        if m and (name is None or m["name"] == name):
            found.append(p)
    return found


def _clean_leftovers(dst: Path) -> None:
    """With ``dst``'s lock held: every writer of ``dst`` that left folders is dead.

    A set-aside old folder with no ``dst`` (a writer killed between its two renames) is
    renamed back; everything else is deleted.
    """
    for p in leftovers(dst.parent, dst.name):
        if p.name.endswith(OLD_SUFFIX) and not dst.exists():
            _audit("restore", p)
            os.rename(p, dst)
            continue
        _audit("clean", p)
        _remove(p)


def sweep(folder: Path) -> list[Path]:
    """Remove the leftovers of killed writers in ``folder``, for every name not being written now."""
    removed = []
    for name in sorted({_LEFTOVER.fullmatch(p.name)["name"] for p in leftovers(folder)}):  # type: ignore[index]
        dst = folder / name
        before = leftovers(folder, name)
        with contextlib.suppress(CkptkitError), locked(dst):
            removed += before
    return removed


def tmp_beside(path: Path) -> Path:
    """A fresh temporary name beside ``path``, of the form :data:`_LEFTOVER` recognises."""
    return path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"


def retire(path: Path) -> None:
    """Delete a published folder so that it is never seen half-deleted under its name:
    with its lock held it is renamed to a temporary name first, then removed. A deletion
    killed midway leaves a leftover that the next writer or :func:`sweep` removes."""
    with locked(path):
        if not path.exists():
            return
        doomed = tmp_beside(path)
        _audit("retire", path)
        os.rename(path, doomed)
        _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        _audit("clean", doomed)
        _remove(doomed)


# --- publishing ---------------------------------------------------------------------------


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def check_replaceable(dst: Path, replace: bool) -> None:
    """A one-line error unless ``dst`` is absent, an empty folder, or a folder we may replace."""
    if not dst.exists() and not dst.is_symlink():
        return
    if dst.is_symlink():
        raise CkptkitError(f"{dst}: is a symbolic link; give the folder it points to")
    if not dst.is_dir():
        raise CkptkitError(f"{dst}: exists and is not a directory")
    if not replace and not _empty_dir(dst):
        raise CkptkitError(f"{dst}: exists and is not empty (pass --force to replace it)")


def _put_in_place(tmp: Path, dst: Path) -> None:
    if not dst.exists() or _empty_dir(dst):
        _audit("rename", tmp)
        os.rename(tmp, dst)  # replaces an empty folder atomically
    else:
        _audit("exchange", tmp)
        if exchange(tmp, dst):  # tmp now holds the old checkpoint
            _audit("delete-old", tmp)
            shutil.rmtree(tmp)
        else:
            aside = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX) + OLD_SUFFIX)
            _audit("aside", dst)
            os.rename(dst, aside)
            _audit("rename", tmp)
            os.rename(tmp, dst)
            _audit("delete-old", aside)
            shutil.rmtree(aside)
    _audit("sync-parent", dst.parent)
    _fsync(dst.parent, os.O_RDONLY | os.O_DIRECTORY)


def os_error_line(dst: Path, e: OSError) -> str:
    """One line for an OS error while publishing ``dst``: the DST when it was ours to write."""
    cause = e.strerror or str(e)
    if e.filename:
        where, target = Path(os.fsdecode(e.filename)).absolute(), dst.absolute()
        ours = where == target or where in target.parents
        if not ours and target.parent in where.parents:
            top = where.relative_to(target.parent).parts[0]
            ours = top == target.name or top.startswith(f".{target.name}.")
        if not ours:
            return f"{e.filename}: {cause}"  # e.g. a source file that could not be read
    return f"{dst}: cannot write: {cause}"


def write_error(dst: Path, e: OSError) -> WriteError:
    """``e`` as one line naming ``dst`` (an OSError too: errno, strerror and filename kept)."""
    error = WriteError(os_error_line(dst, e))
    error.errno, error.strerror, error.filename = e.errno, e.strerror, e.filename
    return error


@contextlib.contextmanager
def parents_made(dst: Path) -> Iterator[None]:
    """The missing folders above ``dst`` created for the block, and removed again (when
    still empty) if it fails: a failed write leaves no trace, not even a parent."""
    missing = [p for p in dst.absolute().parents if not p.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in missing:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


@contextlib.contextmanager
def publishing(dst: str | Path, replace: bool = False, placed: list[Path] | None = None) -> Iterator[Path]:
    """A fresh folder to write ``dst`` into; put in place when the block succeeds.

    Args:
        dst: the folder to create or replace.
        replace: whether a non-empty ``dst`` may be replaced (``--force``).
        placed: ``dst`` is appended to it once in place, with no stop signal in between
            (a stop may still end the process before ``publishing`` returns).

    Raises CkptkitError (one line naming ``dst``) for a refused ``dst``, a concurrent
    writer, or an OS error while writing; ``dst`` is then unchanged and nothing is left
    beside it.
    """
    dst = Path(dst)
    try:
        with parents_made(dst), locked(dst):
            check_replaceable(dst, replace)
            tmp = tmp_beside(dst)
            _audit("mkdir", tmp)
            os.mkdir(tmp, 0o777)  # the umask decides, as for any folder the user creates
            try:
                yield tmp
                _audit("fsync", tmp)
                fsync_tree(tmp)
                check_replaceable(dst, replace)
                with stops_held():  # a stop never falls between the rename and its record
                    _put_in_place(tmp, dst)
                    if placed is not None:
                        placed.append(dst)
            except BaseException:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
    except CkptkitError:
        raise
    except OSError as e:
        raise write_error(dst, e) from None


@contextlib.contextmanager
def publishing_file(dst: str | Path, replace: bool = False) -> Iterator[Path]:
    """A temporary file path beside ``dst`` to write one file into: fsynced and renamed
    onto ``dst`` when the block succeeds, under ``dst``'s lock (:func:`publishing` for a
    file). ``dst`` is then complete, or as it was; nothing is left beside it."""
    dst = Path(dst)
    try:
        with parents_made(dst), locked(dst):
            _check_file_replaceable(dst, replace)
            tmp = tmp_beside(dst)
            try:
                yield tmp
                _audit("fsync", tmp)
                _fsync(tmp, os.O_RDONLY)
                _check_file_replaceable(dst, replace)
                _audit("rename", tmp)
                os.replace(tmp, dst)
                _fsync(dst.parent, os.O_RDONLY | os.O_DIRECTORY)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
    except CkptkitError:
        raise
    except OSError as e:
        raise write_error(dst, e) from None


def _check_file_replaceable(dst: Path, replace: bool) -> None:
    if dst.is_symlink():
        raise CkptkitError(f"{dst}: is a symbolic link; give a plain file path")
    if dst.exists():
        if not dst.is_file():
            raise CkptkitError(f"{dst}: exists and is not a file")
        if not replace:
            raise CkptkitError(f"{dst}: exists (pass --force to replace it)")
