"""Every reader reads through ``ckptkit.io.SourceFile``: a checkpoint whose files are not on this
disk (here: bytes in a dict, mounted at a folder that does not exist) converts to the same
bytes as the same checkpoint read from disk."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ckptkit.convert import convert
from ckptkit.errors import CkptkitError
from ckptkit.formats import REGISTRY
from ckptkit.io import SourceFile, mounted

from conftest import FIXTURES, tree_hashes

SOURCES = ("meta", "hf", "hf-bin", "dcp", "dcp-titan")


class MemoryFile:
    """A source file whose bytes are a bytearray: no path, no descriptor."""

    def __init__(self, path: Path, data: bytearray, reads: list[int]) -> None:
        self.path, self._data, self._reads = path, data, reads

    def size(self) -> int:
        return len(self._data)

    def readinto(self, view: memoryview, offset: int) -> int:
        piece = self._data[offset : offset + len(view)]
        view[: len(piece)] = piece
        self._reads.append(len(piece))
        return len(piece)

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        pass


@contextmanager
def in_memory(src: Path, at: Path) -> Iterator[list[int]]:
    """``src`` (a folder or one file) read into a dict of bytearrays and mounted at ``at``;
    yields the list of read sizes the mounted files served."""
    found = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    files = {p.relative_to(src): bytearray(p.read_bytes()) for p in found}
    reads: list[int] = []

    def opener(path: Path, data: bytearray) -> Callable[[], SourceFile]:
        return lambda: MemoryFile(path, data, reads)

    with mounted({at / rel: opener(at / rel, data) for rel, data in files.items()}):
        yield reads


def _hashes(path: Path) -> dict[str, str]:
    return tree_hashes(path) if path.is_dir() else {"": hashlib.sha256(path.read_bytes()).hexdigest()}


def _outcome(src: Path, dst: Path, to: str) -> dict[str, str] | str:
    try:
        convert(src, dst, to)
    except CkptkitError as e:  # a conversion the format refuses: refused alike from memory
        return re.sub(r"/tmp/ckptkit-gguf-\w+", "TMP", str(e).replace(str(src), "SRC"))
    return _hashes(dst)


def _target(tmp: Path, name: str, to: str) -> Path:
    return tmp / (f"{name}.gguf" if REGISTRY[to].writes_file else name)


def _same_from_memory(src: Path, tmp: Path, targets: list[str]) -> None:
    virtual = tmp / "nowhere" / src.name  # never created: the files exist only in memory
    for to in targets:
        expected = _outcome(src, _target(tmp, f"disk-{to}", to), to)
        with in_memory(src, virtual) as reads:
            got = _outcome(virtual, _target(tmp, f"mem-{to}", to), to)
        assert not virtual.parent.exists()
        assert got == expected, f"{src} -> {to}"
        assert sum(reads) > 0


def _fixtures() -> list[Path]:
    return sorted(p for fmt in SOURCES for p in (FIXTURES / fmt).iterdir() if p.is_dir())


@pytest.mark.parametrize("src", _fixtures(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fixture_converts_from_memory_as_from_disk(src: Path, tmp_path: Path) -> None:
    _same_from_memory(src, tmp_path, list(REGISTRY))


def test_a_gguf_converts_from_memory_as_from_disk(tmp_path: Path) -> None:
    gguf = tmp_path / "made" / "llama2.gguf"
    convert(FIXTURES / "hf" / "llama2", gguf, "gguf")
    _same_from_memory(gguf, tmp_path, list(REGISTRY))
