"""The stream copy: windows over spans, bytes and CRC-32s equal to the plain
concatenation, source zip records checked on the way (and when only part is copied), the
I/O split into small calls, and the buffer kept off transparent huge pages."""

from __future__ import annotations

import ctypes
import os
import re
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from ckptkit import streamcopy
from ckptkit.errors import CkptkitError
from ckptkit.formats.torch_io import TorchPickleReader
from ckptkit.rawcopy import Span, take, take_rows, transfer
from ckptkit.transforms import ROPE_Q


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> tuple[Path, bytes]:
    data = os.urandom(3 * streamcopy.BUFFER + 4321)
    path = tmp_path_factory.mktemp("stream") / "src.bin"
    path.write_bytes(data)
    return path, data


def _copy(spans: list[Span], out: Path, method: str = "stream", want_crc: bool = False, at: int = 3):
    out.write_bytes(b"\xee" * (at + sum(s.nbytes for s in spans) + 5))
    fd = os.open(out, os.O_RDWR)
    try:
        done = transfer(spans, fd, at, method, want_crc=want_crc)
    finally:
        os.close(fd)
    return done, out.read_bytes()[at : at + sum(s.nbytes for s in spans)]


def test_a_long_span_is_cut_into_buffer_sized_windows(blob) -> None:
    path, data = blob
    ws = list(streamcopy.windows([Span(path, 10, len(data) - 10)]))
    assert [w.hi - w.lo for w in ws[:-1]] == [streamcopy.BUFFER] * (len(ws) - 1)
    assert sum(w.held for w in ws) == len(data) - 10 and ws[0].lo == 10


def test_rows_permuted_within_a_head_share_one_window(tmp_path: Path) -> None:
    """Llama 2 7B shapes: a q head is 128 rows of 8 KiB; HF -> Meta interleaves its halves."""
    cfg = type("Cfg", (), {"num_heads": 4, "num_kv_heads": 4})()
    shape = (4 * 128, 4096)
    src = tmp_path / "q.bin"
    with src.open("wb") as f:
        f.truncate(shape[0] * shape[1] * 2)
    spans = ROPE_Q.forward_spans([Span(src, 0, shape[0] * shape[1] * 2)], shape, cfg, [shape])[0]
    ws = list(streamcopy.windows(spans))
    assert len(spans) > 500 and len(ws) == 1  # 4 heads of 1 MiB fit one 4 MiB window
    assert not streamcopy.sparse(spans)


def test_a_column_slice_of_every_row_is_sparse(blob) -> None:
    path, _ = blob
    columns = take_rows([Span(path, 0, 64 * 8192)], 1024, list(range(0, 512, 8)))  # 1 KiB of every 8 KiB
    assert streamcopy.sparse(columns)
    done, _ = _copy(columns, path.parent / "cols.bin", "auto")
    assert done.method == "gather"


@pytest.mark.parametrize("chunk", [streamcopy.IO_CHUNK, 1000])
def test_stream_writes_the_concatenation_and_its_crc(blob, chunk: int, tmp_path: Path, monkeypatch) -> None:
    path, data = blob
    monkeypatch.setattr(streamcopy, "IO_CHUNK", chunk)
    monkeypatch.setattr(streamcopy, "IOV_MAX", 7)
    rows = [9, 2, 2, 30, 0, 31] + list(range(40, 3000, 3))
    spans = take_rows([Span(path, 100, 3000 * 1024)], 1024, rows) + take(
        [Span(path, 0, len(data))], 5, 2 * streamcopy.BUFFER + 77
    )
    expected = (
        b"".join(data[100 + r * 1024 : 100 + (r + 1) * 1024] for r in rows) + data[5 : 5 + 2 * streamcopy.BUFFER + 77]
    )
    done, written = _copy(spans, tmp_path / "out.bin", want_crc=True)
    assert written == expected
    assert done.method == "stream" and done.crc == zlib.crc32(expected)


def test_a_source_that_ends_early_is_an_error(blob, tmp_path: Path) -> None:
    path, data = blob
    with pytest.raises(EOFError):
        _copy([Span(path, len(data) - 10, 20)], tmp_path / "out.bin")


def _corrupt_pth(tmp_path: Path, where: float) -> tuple[Path, str, torch.Tensor]:
    """A real torch.save file with one bit flipped at fraction ``where`` of its largest record."""
    t = torch.randn(512, 1024).to(torch.bfloat16)  # 1 MiB
    path = tmp_path / "m.pth"
    torch.save({"small": torch.ones(3), "w": t}, path)
    with zipfile.ZipFile(path) as z:
        zi = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    n, m = struct.unpack("<HH", data[zi.header_offset + 26 : zi.header_offset + 30])
    data[zi.header_offset + 30 + n + m + int(zi.file_size * where)] ^= 0x10
    path.write_bytes(bytes(data))
    return path, "w", t


@pytest.mark.parametrize("method", ["stream", "copy_file_range", "gather"])
def test_a_corrupt_source_record_is_caught_while_copying(method: str, tmp_path: Path) -> None:
    path, key, _ = _corrupt_pth(tmp_path, 0.7)
    span = TorchPickleReader(path).span(key)
    assert span is not None and span.check is not None
    with pytest.raises(CkptkitError, match="fails its CRC-32 check"):
        _copy([span], tmp_path / "out.bin", method)


def test_copying_part_of_a_record_still_checks_all_of_it(tmp_path: Path) -> None:
    """The flipped bit lies outside the rows copied: the record is read to check it."""
    path, key, _ = _corrupt_pth(tmp_path, 0.9)
    span = TorchPickleReader(path).span(key)
    with pytest.raises(CkptkitError, match="fails its CRC-32 check"):
        _copy(take([span], 0, span.nbytes // 2), tmp_path / "out.bin")


def test_a_sound_record_is_checked_once_by_the_stream_itself(tmp_path: Path, monkeypatch) -> None:
    t = torch.randn(1024, 1024).to(torch.bfloat16)  # 2 MiB: one window
    torch.save({"w": t}, tmp_path / "ok.pth")
    reader = TorchPickleReader(tmp_path / "ok.pth")
    span = reader.span("w")
    reads = []
    monkeypatch.setattr(type(span.check.verifier), "verify", lambda self, c: reads.append(c))
    done, written = _copy([span], tmp_path / "out.bin", want_crc=True)
    assert written == t.view(torch.uint8).numpy().tobytes() and done.crc == span.crc
    assert reads == [] and span.check.verifier.verified(span.check.key)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_buffer_is_not_backed_by_transparent_huge_pages() -> None:
    """Copying out of huge pages made writes 3-6x slower on the development VM."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(streamcopy.buffer()))
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            if entry is not None:
                break
            if int(m[1], 16) <= address < int(m[2], 16):
                entry = {}
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry is not None, "the buffer's mapping is not in /proc/self/smaps"
    assert "nh" in entry["VmFlags"].split()  # MADV_NOHUGEPAGE
    assert entry.get("THPeligible", "0") == "0"
