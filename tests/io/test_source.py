"""Every reader reads through ``ckptkit.io.SourceFile``: a checkpoint whose files are not on this
disk (here: bytes in a dict, mounted at a folder that does not exist) converts to the same
bytes as the same checkpoint read from disk."""

from __future__ import annotations

import hashlib
import os
import random
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats import REGISTRY
from ckptkit.formats.torch_io import TorchPickleReader
from ckptkit.io import AUTO, SourceFile, Span, mounted
from ckptkit.io.transfer import METHODS, STREAM, transfer

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
def in_memory(src: Path, at: Path) -> Iterator[tuple[dict[Path, bytearray], list[int]]]:
    """``src`` (a folder or one file) read into a dict of bytearrays and mounted at ``at``;
    yields that dict (by mounted path) and the list of read sizes the mounted files served."""
    found = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    files = {at / p.relative_to(src): bytearray(p.read_bytes()) for p in found}
    reads: list[int] = []

    def opener(path: Path, data: bytearray) -> Callable[[], SourceFile]:
        return lambda: MemoryFile(path, data, reads)

    with mounted({path: opener(path, data) for path, data in files.items()}):
        yield files, reads


def _hashes(path: Path) -> dict[str, str]:
    return tree_hashes(path) if path.is_dir() else {"": hashlib.sha256(path.read_bytes()).hexdigest()}


def _outcome(src: Path, dst: Path, to: str, verify: bool = False) -> dict[str, str] | str:
    try:
        convert(src, dst, ConvertOptions(to, verify=verify))
    except CkptkitError as e:  # a conversion the format refuses: refused alike from memory
        return re.sub(r"/tmp/ckptkit-gguf-\w+", "TMP", str(e).replace(str(src), "SRC"))
    return _hashes(dst)


def _target(tmp: Path, name: str, to: str) -> Path:
    suffix = REGISTRY[to].info.file_suffix
    return tmp / (name + suffix if suffix is not None else name)


def _same_from_memory(src: Path, tmp: Path, targets: list[str]) -> None:
    virtual = tmp / "nowhere" / src.name  # never created: the files exist only in memory
    for to in targets:
        expected = _outcome(src, _target(tmp, f"disk-{to}", to), to)
        with in_memory(src, virtual) as (_, reads):
            # verify: every tensor of the source read again (Lazy.get) and compared with the output's
            got = _outcome(virtual, _target(tmp, f"mem-{to}", to), to, verify=True)
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
    convert(FIXTURES / "hf" / "llama2", gguf, ConvertOptions("gguf"))
    _same_from_memory(gguf, tmp_path, list(REGISTRY))


@pytest.mark.parametrize("method", [AUTO, *METHODS])
def test_every_copy_method_copies_spans_of_a_file_not_on_this_disk(method: str, tmp_path: Path) -> None:
    """gather and the range methods need a descriptor: spans of a mounted file are streamed
    (or read and written) instead, with the same bytes and CRC-32."""
    data = bytearray(random.Random(0).randbytes(6 << 20))
    src = tmp_path / "nowhere" / "w.bin"
    dense = [Span(src, 5, 1000), Span(src, 1 << 20, 5 << 20), Span(src, 100, 50)]
    scattered = [Span(src, 4096 + 997 * i, 13) for i in range(300)]  # what auto gathers from a local file
    reads: list[int] = []
    for spans in (dense, scattered):
        reads.clear()
        expected = b"".join(bytes(data[s.offset : s.offset + s.nbytes]) for s in spans)
        out = tmp_path / "out"
        out.write_bytes(b"\0" * (len(expected) + 7))
        fd = os.open(out, os.O_RDWR)
        try:
            with mounted({src: lambda: MemoryFile(src, data, reads)}):
                done = transfer(spans, fd, 7, method, want_crc=True)
        finally:
            os.close(fd)
        assert out.read_bytes() == b"\0" * 7 + expected
        assert done.crc == zlib.crc32(expected)
        assert done.method in (STREAM, "readwrite") and sum(reads) >= len(expected)


def test_a_corrupt_record_of_a_pth_not_on_this_disk_fails_its_crc_check(tmp_path: Path) -> None:
    src = FIXTURES / "meta" / "llama2"
    span = TorchPickleReader(src / "consolidated.00.pth").span("layers.0.attention.wq.weight")
    assert span is not None and span.check is not None
    virtual = tmp_path / "nowhere" / "llama2"
    with in_memory(src, virtual) as (files, _):
        files[virtual / "consolidated.00.pth"][span.offset + 3] ^= 0x40
        with pytest.raises(CkptkitError, match=r"consolidated\.00\.pth: record data/\w+ fails its CRC-32 check"):
            convert(virtual, tmp_path / "out", ConvertOptions("hf"))
    assert not (tmp_path / "out").exists()
