"""Checks on what is read from a source folder: which files, which names, which JSON.

Everything here raises :class:`CkptkitError` with one line naming the file. The checks
run before the bytes are used: a FIFO is never opened for a blocking read, a symlink out
of the checkpoint folder is never followed, a recorded file name never becomes a path
outside the folder it belongs in.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import chain
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError

MAX_JSON_DEPTH = 64


# --- files --------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def open_regular(path: Path) -> int:
    """A read-only fd of ``path``, refusing anything but a regular file without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CkptkitError(f"{path}: cannot read: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CkptkitError(f"{path}: is {_kind(mode)}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return fd


def check_regular(path: Path) -> None:
    """A one-line error unless ``path`` (followed) is a regular file."""
    os.close(open_regular(path))


def allowed_root(root: Path) -> Path:
    """The folder symlinks in ``root`` may point into: ``root`` itself, or for a Hugging Face
    cache snapshot (``models--X/snapshots/REV``, or a folder inside it) the ``models--X``
    folder holding its blobs."""
    real = root.resolve()
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            return folder.parent.parent
    return real


def check_entry(root: Path, path: Path) -> None:
    """A one-line error if ``path`` (in ``root``) is a symlink leaving ``root`` or not a
    regular file or folder (FIFOs, devices, sockets)."""
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except FileNotFoundError:
            raise CkptkitError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        except (RuntimeError, OSError) as e:  # a loop: RuntimeError before Python 3.13, OSError (ELOOP) since
            cause = getattr(e, "strerror", None) or "it leads back to itself"
            raise CkptkitError(f"{path}: a symbolic link that cannot be followed: {cause}") from None
        home = allowed_root(root)
        if target != home and home not in target.parents:
            raise CkptkitError(
                f"{path}: a symbolic link to {target}, outside the checkpoint folder; refusing to follow it"
            )
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CkptkitError(f"{path}: cannot read: {e.strerror}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise CkptkitError(f"{path}: is {_kind(mode)}; a checkpoint folder holds regular files only")


def check_source_folder(root: Path) -> None:
    """Every visible top-level entry of a source checkpoint folder passes :func:`check_entry`."""
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise CkptkitError(f"{root}: cannot read: {e.strerror}") from None
    for p in entries:
        if not p.name.startswith("."):
            check_entry(root, p)


# --- names ------------------------------------------------------------------------------


def plain_name(name: object, where: Path, pattern: re.Pattern[str] | None = None, what: str = "file name") -> str:
    """``name`` if it is a plain base name (no folder, no ``..``) matching ``pattern``."""
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not name.startswith(".")
        and (pattern is None or pattern.fullmatch(name) is not None)
    )
    if not ok:
        shown = name if isinstance(name, str) else type(name).__name__
        expected = f" matching {pattern.pattern}" if pattern is not None else ""
        raise CkptkitError(f"{where}: invalid {what} {shown!r} (expected a plain file name{expected})")
    return name  # type: ignore[return-value]


# --- JSON -------------------------------------------------------------------------------


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _depth(value: object, limit: int) -> int:
    """The nesting depth of a parsed JSON value (a scalar: 1; a container: one more than its
    deepest item, 1 when empty), counted no further than ``limit + 1``: level by level, the
    items of a whole level flattened at once and only its containers kept for the next (a
    128k-entry vocabulary or 280k two-item merges cost one pass, no loop per container)."""
    containers = (dict, list)
    level = [value] if isinstance(value, containers) else []
    deepest = 1
    while level and deepest <= limit:
        items = list(chain.from_iterable([v.values() if isinstance(v, dict) else v for v in level]))
        if not items:
            break
        deepest += 1
        level = [x for x in items if isinstance(x, containers)]
    return deepest


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {twice!r} appears twice")
    return out


def loads_json(text: str | bytes, where: Path, what: str = "invalid JSON", unique_keys: bool = False) -> Any:
    """Strict JSON: no NaN/Infinity, finite numbers, nesting at most MAX_JSON_DEPTH, and
    with ``unique_keys`` no name twice in an object."""
    hook = _unique if unique_keys else None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=hook)
    except json.JSONDecodeError as e:
        raise CkptkitError(f"{where}: {what} at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError:
        raise CkptkitError(f"{where}: {what} (not UTF-8)") from None
    except RecursionError:
        raise CkptkitError(f"{where}: {what} (nested too deeply)") from None
    except ValueError as e:  # NaN/Infinity, out-of-range numbers, over-long integers
        raise CkptkitError(f"{where}: {what} ({str(e).splitlines()[0]})") from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise CkptkitError(f"{where}: {what} (nested deeper than {MAX_JSON_DEPTH} levels)")
    return value
