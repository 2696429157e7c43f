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

from ckptkit.errors import CkptkitError
from ckptkit.formats.torch_io import TorchPickleReader
from ckptkit.io import stream
from ckptkit.io.spans import Span, take, take_rows
from ckptkit.io.transfer import transfer
from ckptkit.tensors.transforms import ROPE_Q


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> tuple[Path, bytes]:
    data = os.urandom(3 * stream.BUFFER + 4321)
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
    ws = list(stream.windows([Span(path, 10, len(data) - 10)]))
    assert [w.hi - w.lo for w in ws[:-1]] == [stream.BUFFER] * (len(ws) - 1)
    assert sum(w.held for w in ws) == len(data) - 10 and ws[0].lo == 10


def test_rows_permuted_within_a_head_share_one_window(tmp_path: Path) -> None:
    """Llama 2 7B shapes: a q head is 128 rows of 8 KiB; HF -> Meta interleaves its halves."""
    cfg = type("Cfg", (), {"num_heads": 4, "num_kv_heads": 4})()
    shape = (4 * 128, 4096)
    src = tmp_path / "q.bin"
    with src.open("wb") as f:
        f.truncate(shape[0] * shape[1] * 2)
    spans = ROPE_Q.forward_spans([Span(src, 0, shape[0] * shape[1] * 2)], shape, cfg, [shape])[0]
    ws = list(stream.windows(spans))
    assert len(spans) > 500 and len(ws) == 1  # 4 heads of 1 MiB fit one 4 MiB window
    assert not stream.sparse(spans)


def test_a_column_slice_of_every_row_is_sparse(blob) -> None:
    path, _ = blob
    columns = take_rows([Span(path, 0, 64 * 8192)], 1024, list(range(0, 512, 8)))  # 1 KiB of every 8 KiB
    assert stream.sparse(columns)
    done, _ = _copy(columns, path.parent / "cols.bin", "auto")
    assert done.method == "gather"


@pytest.mark.parametrize("chunk", [stream.IO_CHUNK, 1000])
def test_stream_writes_the_concatenation_and_its_crc(blob, chunk: int, tmp_path: Path, monkeypatch) -> None:
    path, data = blob
    monkeypatch.setattr(stream, "IO_CHUNK", chunk)
    monkeypatch.setattr(stream, "IOV_MAX", 7)
    rows = [9, 2, 2, 30, 0, 31] + list(range(40, 3000, 3))
    spans = take_rows([Span(path, 100, 3000 * 1024)], 1024, rows) + take(
        [Span(path, 0, len(data))], 5, 2 * stream.BUFFER + 77
    )
    expected = (
        b"".join(data[100 + r * 1024 : 100 + (r + 1) * 1024] for r in rows) + data[5 : 5 + 2 * stream.BUFFER + 77]
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
    address = ctypes.addressof(ctypes.c_char.from_buffer(stream.buffer()))
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


def _rekeyed_pth(tmp_path: Path, key: str, corrupt: bool) -> Path:
    """A torch.save file whose storage record is renamed ``data/<key>`` (pickle and zip
    member both), optionally with one data byte flipped under the recorded CRC."""
    src, out = tmp_path / "a.pth", tmp_path / f"rekeyed-{corrupt}.pth"
    values = torch.arange(16, dtype=torch.float32)
    torch.save({"w": values}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for zi in zin.infolist():
            data, name = zin.read(zi), zi.filename
            if name.endswith("data.pkl"):
                old = b"X\x01\x00\x00\x000"  # BINUNICODE "0", the storage key
                assert data.count(old) == 1
                data = data.replace(old, b"X" + len(key).to_bytes(4, "little") + key.encode())
            if name.endswith("/data/0"):
                name = name[:-1] + key
            zout.writestr(name, data)
    if corrupt:
        raw = bytearray(out.read_bytes())
        raw[raw.find(values.numpy().tobytes()) + 5] ^= 0xFF
        out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_storage_that_is_not_a_plain_record_is_refused_not_trusted(corrupt: bool, tmp_path: Path) -> None:
    """A key with "/" is no record torch writes; its CRC could not be looked up, so the
    tensor was once read unchecked (a flipped byte passed)."""
    assert torch.equal(TorchPickleReader(_rekeyed_pth(tmp_path, "0", False)).read("w"), torch.arange(16.0))
    reader = TorchPickleReader(_rekeyed_pth(tmp_path, "0/x", corrupt))
    with pytest.raises(CkptkitError, match="not a plain stored record"):
        reader.read("w")


def test_without_preadv_and_pwritev_auto_uses_the_range_methods(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stream, "AVAILABLE", False)
    monkeypatch.delattr(os, "preadv")
    monkeypatch.delattr(os, "pwritev")
    t = torch.randn(256, 512).to(torch.bfloat16)
    torch.save({"w": t}, tmp_path / "ok.pth")
    span = TorchPickleReader(tmp_path / "ok.pth").span("w")
    done, written = _copy(take([span], 1000, 50_000), tmp_path / "out.bin", "auto", want_crc=True)
    assert done.method == "copy_file_range" and written == t.view(torch.uint8).numpy().tobytes()[1000:51000]
    assert done.crc == zlib.crc32(written)
    path, key, _ = _corrupt_pth(tmp_path, 0.5)
    with pytest.raises(CkptkitError, match="fails its CRC-32 check"):
        _copy([TorchPickleReader(path).span(key)], tmp_path / "bad.bin", "auto")


def test_a_record_shared_by_concurrent_jobs_is_read_once(tmp_path: Path, monkeypatch) -> None:
    """Eight row ranges of one record (a Meta rank split) copied on two threads: the
    record's CRC-32 is computed once, not once per thread."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptkit.io import records

    read: list[int] = []
    real = records.crc32_range
    monkeypatch.setattr(records, "crc32_range", lambda fd, off, n, *a, **k: read.append(n) or real(fd, off, n))
    t = torch.randn(2048, 2048).to(torch.bfloat16)  # 8 MiB
    torch.save({"w": t}, tmp_path / "big.pth")
    span = TorchPickleReader(tmp_path / "big.pth").span("w")
    pieces = [take([span], i * span.nbytes // 8, span.nbytes // 8) for i in (7, 3, 5, 1, 6, 2, 4, 0)]
    out = tmp_path / "out.bin"
    out.write_bytes(bytes(span.nbytes))
    fd = os.open(out, os.O_RDWR)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: transfer(p, fd, p[0].offset - span.offset), pieces))
    finally:
        os.close(fd)
    assert out.read_bytes() == t.view(torch.uint8).numpy().tobytes()
    assert sum(read) <= span.nbytes


def test_a_record_cut_short_after_opening_is_one_line(tmp_path: Path) -> None:
    t = torch.randn(512, 512).to(torch.bfloat16)
    torch.save({"w": t}, tmp_path / "m.pth")
    span = TorchPickleReader(tmp_path / "m.pth").span("w")
    os.truncate(tmp_path / "m.pth", span.offset + span.nbytes // 2)
    with pytest.raises(CkptkitError, match="cut short"):
        span.check.verifier.verify(span.check)
