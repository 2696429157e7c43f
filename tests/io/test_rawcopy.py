"""File-to-file copies (each method forced, and the automatic fallback), CRC-32 over mmap,
the readers' spans (where a tensor's bytes lie, checked against files torch and the
safetensors library wrote), and the transforms' span maps checked against the transforms."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptkit.errors import CkptkitError
from ckptkit.formats.safetensors_io import SafetensorsReader, SafetensorsWriter
from ckptkit.formats.torch_io import TorchPickleReader
from ckptkit.formats.torch_writer import TorchPickleWriter
from ckptkit.io import transfer
from ckptkit.io.spans import Span, coalesce, take, take_rows
from ckptkit.io.stream import crc32_range
from ckptkit.io.transfer import DIRECT, METHODS, RANGE_METHODS, STREAM, copy_range, copy_spans, spans_crc32
from ckptkit.tensors.transforms import FUSED, RANKS, ROPE_K, ROPE_Q

from conftest import direct_supported


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> tuple[Path, bytes]:
    data = os.urandom(3 * transfer.BUFFER // 2 + 12345)  # the read/write path needs two buffers
    path = tmp_path_factory.mktemp("rawcopy") / "src.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("method", RANGE_METHODS)
def test_each_method_copies_exactly_the_range_at_the_offset(method: str, payload, tmp_path: Path) -> None:
    src, data = payload
    dst = tmp_path / "dst.bin"
    before = b"\xaa" * (len(data) + 1000)
    dst.write_bytes(before)
    start, count, at = 777, len(data) - 1777, 501
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR)
    try:
        assert copy_range(s, start, d, at, count, method) == method
    finally:
        os.close(s)
        os.close(d)
    assert dst.read_bytes() == before[:at] + data[start : start + count] + before[at + count :]


def test_a_source_that_ends_early_is_an_error(payload, tmp_path: Path) -> None:
    src, data = payload
    s, d = os.open(src, os.O_RDONLY), os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        for method in RANGE_METHODS:
            with pytest.raises(EOFError):
                copy_range(s, len(data) - 10, d, 0, 20, method)
    finally:
        os.close(s)
        os.close(d)


def test_auto_falls_back_when_the_kernel_refuses_a_cross_filesystem_copy(payload, tmp_path: Path) -> None:
    """copy_file_range refuses EXDEV between different filesystems (tmpfs -> disk): sendfile takes over."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a different filesystem than the temporary directory")
    _, data = payload
    src = shm / f"ckptkit-test-{os.getpid()}.bin"
    src.write_bytes(data[:100_000])
    dst = tmp_path / "dst.bin"
    try:
        s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(OSError):
                os.copy_file_range(s, d, 10, 0, 0)
            assert copy_range(s, 0, d, 0, 100_000) == "sendfile"
        finally:
            os.close(s)
            os.close(d)
    finally:
        src.unlink()
    assert dst.read_bytes() == data[:100_000]


def test_crc32_over_mmap_windows_matches_zlib(payload) -> None:
    src, data = payload
    fd = os.open(src, os.O_RDONLY)
    try:
        for offset, n, window in [(0, len(data), 1 << 20), (4097, 3 * 65536 + 5, 65536), (10, 0, 65536)]:
            assert crc32_range(fd, offset, n, window) == zlib.crc32(data[offset : offset + n])
    finally:
        os.close(fd)
    assert spans_crc32([Span(src, 3, 100, crc=12345)]) == 12345  # a recorded CRC is used as is


@pytest.fixture(scope="module")
def sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randint(0, 100, (5, 3), generator=g, dtype=torch.int64),
        "d": torch.randn(16, 8, generator=g).to(torch.float16),
        "e": torch.randn(300, 701, generator=g),  # 841,200 bytes: whole pages to write direct
    }


def _span_bytes(span: Span) -> bytes:
    with span.path.open("rb") as f:
        f.seek(span.offset)
        return f.read(span.nbytes)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_spans_of_library_and_torch_files_hold_the_tensor_bytes(sd, tmp_path: Path) -> None:
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "m.pth")
    st, pt = SafetensorsReader(tmp_path / "m.safetensors"), TorchPickleReader(tmp_path / "m.pth")
    with zipfile.ZipFile(tmp_path / "m.pth") as z:
        crcs = {zi.filename.rsplit("/", 1)[1]: zi.CRC for zi in z.infolist() if "/data/" in zi.filename}
    for k, t in sd.items():
        assert _span_bytes(st.span(k)) == _raw(t)
        span = pt.span(k)
        assert _span_bytes(span) == _raw(t)
        assert span.crc == zlib.crc32(_raw(t)) and span.crc in crcs.values()


def test_views_into_shared_or_strided_storage(tmp_path: Path) -> None:
    """A view at an offset in a bigger storage has a span (without the record's CRC); a
    transposed one has none."""
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    torch.save(
        {"rows": base[2:4], "t": base.t(), "whole": base, "head": base[:2], "tail": base[4:]}, tmp_path / "v.pth"
    )
    r = TorchPickleReader(tmp_path / "v.pth")
    rows = r.span("rows")
    assert _span_bytes(rows) == _raw(base[2:4]) and rows.crc is None
    assert r.span("t") is None
    assert r.span("whole").crc == zlib.crc32(_raw(base))
    for part, view in (("head", base[:2]), ("tail", base[4:])):  # one end of the storage: not its CRC
        assert _span_bytes(r.span(part)) == _raw(view) and r.span(part).crc is None
    # read: each as torch.load gives it, contiguous, the shared record's CRC-32 checked
    loaded = torch.load(tmp_path / "v.pth", weights_only=True)
    for name in ("rows", "t", "whole", "head", "tail", "rows"):
        got = r.read(name)
        assert got.is_contiguous() and torch.equal(got, loaded[name]), name
    assert r.sample("t", 8) == _raw(base.t().contiguous())[:8]  # its first elements, in row-major order


def test_safetensors_sample_is_a_tensor_s_first_bytes(sd, tmp_path: Path) -> None:
    save_file(sd, str(tmp_path / "m.safetensors"))
    reader = SafetensorsReader(tmp_path / "m.safetensors")
    for k, t in sd.items():
        assert reader.sample(k, 5) == _raw(t)[:5] and reader.sample(k, 10**9) == _raw(t)


def test_a_closed_safetensors_reader_reopens_on_the_next_read(sd, tmp_path: Path) -> None:
    save_file(sd, str(tmp_path / "m.safetensors"))
    reader = SafetensorsReader(tmp_path / "m.safetensors")
    name, t = next(iter(sd.items()))
    for _ in range(2):
        assert _raw(reader.read(name)) == _raw(t)
        reader.close()
    reader.close()  # closing twice is harmless


def _mapping_rss_kib(address: int) -> int:
    """Resident KiB of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_release_pages_hands_back_exactly_the_pages_a_tensor_touches(tmp_path: Path) -> None:
    """madvise(DONTNEED) on the pages a file-backed tensor overlaps, partial ones at both
    ends included; the pages around stay resident."""
    import mmap

    from ckptkit.formats.torch_io import release_pages

    page = mmap.PAGESIZE
    path = tmp_path / "pages.bin"
    path.write_bytes(os.urandom(64 * page))
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        assert int(whole.sum()) > 0  # every page faulted in
        assert _mapping_rss_kib(whole.data_ptr()) == 64 * page // 1024
        release_pages(whole[10 * page + 100 : 30 * page - 100])  # pages 10..29, partial at both ends
        assert _mapping_rss_kib(whole.data_ptr()) == 44 * page // 1024
        release_pages(whole[40 * page + 7 : 40 * page + 8])  # one byte: its page
        release_pages(whole[50 * page : 50 * page])  # nothing
        assert _mapping_rss_kib(whole.data_ptr()) == 43 * page // 1024
        del whole
    finally:
        mapped.close()


def test_pickle_tensor_is_what_torch_save_of_one_tensor_pickles() -> None:
    import io

    from ckptkit.formats.torch_zip import pickle_tensor

    for dtype, shape in [("bfloat16", (3, 4)), ("float32", (5,)), ("int64", (2, 1, 3)), ("float16", ())]:
        buffer = io.BytesIO()
        torch.save(torch.zeros(shape, dtype=getattr(torch, dtype)), buffer)
        with zipfile.ZipFile(buffer) as z:
            (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
            assert z.read(pkl) == pickle_tensor(dtype, shape), (dtype, shape)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("container", ["safetensors", "pth"])
def test_writing_spans_gives_the_same_file_as_writing_tensors(sd, container: str, method: str, tmp_path) -> None:
    src = tmp_path / f"src.{container}"
    save_file(sd, str(src)) if container == "safetensors" else torch.save(sd, src)
    reader = SafetensorsReader(src) if container == "safetensors" else TorchPickleReader(src)
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in reversed(sd.items())]
    outputs = []
    for fast in (False, True):
        out = tmp_path / str(fast) / f"out.{container}"  # torch names the archive after the file
        out.parent.mkdir()
        st = container == "safetensors"
        w = SafetensorsWriter(out, entries, {"format": "pt"}) if st else TorchPickleWriter(out, entries)
        for k in sd:
            if fast:
                used = w.write_spans(k, [reader.span(k)], method)
                if method == DIRECT and (k != "e" or not direct_supported(out.parent)):
                    assert used in (DIRECT, STREAM)  # small tensors, or no O_DIRECT here, go buffered
                else:
                    assert used == method
            else:
                w.write(k, sd[k])
        w.close()
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    if container == "pth":
        with zipfile.ZipFile(tmp_path / "True/out.pth") as z:
            assert z.testzip() is None  # every CRC-32 matches the bytes
        loaded = torch.load(tmp_path / "True/out.pth", weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_a_pth_writer_computes_the_crc_of_a_safetensors_span(sd, tmp_path: Path) -> None:
    """No CRC recorded in the source: it is computed over the source mapping."""
    save_file(sd, str(tmp_path / "s.safetensors"))
    reader = SafetensorsReader(tmp_path / "s.safetensors")
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in sd.items()]
    (tmp_path / "ref").mkdir()
    w = TorchPickleWriter(tmp_path / "o.pth", entries)
    for k in sd:
        w.write_spans(k, [reader.span(k)])
    w.close()
    torch.save(sd, tmp_path / "ref" / "o.pth")
    with zipfile.ZipFile(tmp_path / "o.pth") as a, zipfile.ZipFile(tmp_path / "ref" / "o.pth") as b:
        assert a.testzip() is None
        data = [n for n in a.namelist() if "/data/" in n]
        assert len(data) == len(sd) and [a.getinfo(n).CRC for n in data] == [b.getinfo(n).CRC for n in data]


def _read(spans: list[Span]) -> bytes:
    return b"".join(_span_bytes(s) for s in spans)


def test_span_lists_slice_permute_and_copy(payload, tmp_path: Path) -> None:
    src, data = payload
    spans = [Span(src, 100, 5000), Span(src, 5100, 3000), Span(src, 20000, 4096)]  # the first two touch
    joined = data[100:8100] + data[20000:24096]
    assert coalesce(spans) == [Span(src, 100, 8000), Span(src, 20000, 4096)]
    assert _read(take(spans, 4000, 6000)) == joined[4000:10000]
    rows = [5, 0, 10, 3, 3]
    assert _read(take_rows(spans, 1024, rows)) == b"".join(joined[r * 1024 : (r + 1) * 1024] for r in rows)
    many = take_rows([Span(src, 0, 64 * 512)], 512, list(range(63, -1, -1)))  # 64 spans: gathered
    expected = b"".join(data[r * 512 : (r + 1) * 512] for r in range(63, -1, -1))
    assert spans_crc32(many) == zlib.crc32(expected) and spans_crc32(spans) == zlib.crc32(joined)
    for method in METHODS:
        out = tmp_path / f"{method}.bin"
        out.write_bytes(bytes(40000))
        fd = os.open(out, os.O_RDWR)
        try:
            used = copy_spans(many, fd, 7)
            copy_spans(spans, fd, 7 + len(expected), method)
        finally:
            os.close(fd)
        assert used == "stream"  # 64 rows of one 32 KiB window: read once, written in order
        assert out.read_bytes()[7 : 7 + len(expected) + len(joined)] == expected + joined


def _stored(t: torch.Tensor, path: Path) -> list[Span]:
    path.write_bytes(_raw(t))
    return [Span(path, 0, t.nbytes)]


@pytest.mark.parametrize("kind", [ROPE_Q, ROPE_K])
def test_rope_span_maps_match_the_permutation(kind, tmp_path: Path) -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2)
    w = torch.arange(16 * 3, dtype=torch.int16).reshape(16, 3)
    spans = _stored(w, tmp_path / "w.bin")
    assert _read(kind.forward_spans(spans, w.shape, cfg, [w.shape])[0]) == _raw(kind.forward(w, cfg, [w.shape])[0])
    assert _read(kind.inverse_spans([spans], [w.shape], cfg)) == _raw(kind.inverse([w], cfg))


def test_fused_and_rank_span_maps_match_the_transforms(tmp_path: Path) -> None:
    w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    spans = _stored(w, tmp_path / "w.bin")
    shapes = [(3, 6), (7, 6)]
    parts = FUSED.forward_spans(spans, w.shape, None, shapes)
    assert [_read(p) for p in parts] == [_raw(p) for p in FUSED.forward(w, None, shapes)]
    assert _read(FUSED.inverse_spans(parts, shapes, None)) == _raw(w)
    for dim in (None, 0, 1):
        shards = RANKS.inverse(w, 2, dim)
        pieces = RANKS.inverse_spans(spans, w.shape, 2, dim)
        assert [_read(p) for p in pieces] == [_raw(s) for s in shards]
        stored = [_stored(s, tmp_path / f"rank{i}-{dim}.bin") for i, s in enumerate(shards)]
        assert _read(RANKS.forward_spans(stored, tuple(shards[0].shape), dim)) == _raw(RANKS.forward(shards, dim))


def test_writers_refuse_spans_of_the_wrong_size_or_for_an_alias(tmp_path: Path) -> None:
    t = torch.arange(8, dtype=torch.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(_raw(t))
    short = [Span(src, 0, 28)]
    st = SafetensorsWriter(tmp_path / "a.safetensors", [("w", torch.float32, (8,))], None)
    with pytest.raises(ValueError, match=r"^w: spans of 28 bytes for a 32-byte tensor$"):
        st.write_spans("w", short)
    st.discard()
    pt = TorchPickleWriter(tmp_path / "a.pth", [("w", torch.float32, (8,)), ("tied", torch.float32, (8,))],
                           aliases={"tied": "w"})  # fmt: skip
    with pytest.raises(ValueError, match=r"^w: spans of 28 bytes for a 32-byte record$"):
        pt.write_spans("w", short)
    with pytest.raises(ValueError, match=r"^tied: stored as w; its bytes are written with that tensor$"):
        pt.write_spans("tied", [Span(src, 0, 32)])
    pt.write_spans("w", [Span(src, 0, 32)])
    pt.close()
    loaded = torch.load(tmp_path / "a.pth", weights_only=True)
    assert (
        torch.equal(loaded["w"], t)
        and loaded["tied"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    )


def _file_rss_kib(path: Path) -> int:
    """Resident KiB of every mapping of ``path`` in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and head == "Rss:":
            total += int(line.split()[1])
    return total


def test_reading_a_pth_leaves_none_of_its_mapped_pages_resident(tmp_path: Path) -> None:
    """torch.load maps the file; the reader copies the tensor out and hands the file's pages
    back, so a 16 MiB tensor read leaves no page of the mapping resident."""
    t = torch.arange(2**22, dtype=torch.float32)
    torch.save({"w": t, "n": torch.ones(3)}, tmp_path / "m.pth")
    reader = TorchPickleReader(tmp_path / "m.pth")
    assert torch.equal(reader.read("w"), t)
    assert _file_rss_kib(tmp_path / "m.pth") < 256  # KiB (the kernel may map a few pages around a fault)


def test_a_pth_saved_from_cuda_tensors_reads_on_a_machine_without_cuda(tmp_path: Path) -> None:
    """The storages' location says cuda:0 (as torch.save writes GPU tensors): plain torch.load
    fails without CUDA, the reader maps them to the CPU."""
    t = torch.arange(6, dtype=torch.float32)
    torch.save({"w": t}, tmp_path / "cpu.pth")
    with zipfile.ZipFile(tmp_path / "cpu.pth") as src, zipfile.ZipFile(tmp_path / "gpu.pth", "w") as out:
        for zi in src.infolist():
            data = src.read(zi)
            if zi.filename.endswith("/data.pkl"):
                assert data.count(b"X\x03\x00\x00\x00cpu") == 1
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            out.writestr(zi.filename, data)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "gpu.pth", weights_only=True)
    assert torch.equal(TorchPickleReader(tmp_path / "gpu.pth").read("w"), t)
    torch.save({"w": t}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)  # read whole, no mmap
    data = (tmp_path / "legacy.pth").read_bytes()
    assert data.count(b"X\x03\x00\x00\x00cpu") == 1
    (tmp_path / "legacy.pth").write_bytes(data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0"))
    assert torch.equal(TorchPickleReader(tmp_path / "legacy.pth").read("w"), t)


def test_a_tensor_pickled_without_strides_is_never_one_stored_range() -> None:
    """``_rebuild_tensor_v2`` always gets strides from torch.save; a pickle without them (or
    with the wrong number) is not taken as dense, so its bytes go through torch.load."""
    from ckptkit.formats.torch_io import _dense

    assert _dense((2, 3), (3, 1)) and _dense((2, 1, 3), (3, 7, 1)) and _dense((2, 3, 4), (12, 4, 1))
    assert not _dense((2, 3, 4), (3, 4, 1)) and not _dense((2, 2), (1, 2))  # strides of a transpose
    assert not _dense((2, 3), None) and not _dense((2, 3), (1,)) and not _dense((2, 3), (1, 2))


def test_safetensors_reads_survive_short_reads_and_name_a_file_cut_after_opening(
    sd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """readinto may return fewer bytes than asked (past 2 GiB on Linux, on network filesystems):
    the reader keeps reading; a file cut short after the header was checked is one line."""
    import ckptkit.formats.safetensors_io as st_io

    save_file(sd, str(tmp_path / "m.safetensors"))
    opened = st_io.open_source

    class Short:  # a source file read 7 bytes at a time, never through its descriptor
        def __init__(self, f) -> None:
            self.f = f

        def readinto(self, view, offset: int) -> int:
            return self.f.readinto(memoryview(view)[:7], offset)

        def fileno(self) -> None:
            return None

        def __getattr__(self, name: str):
            return getattr(self.f, name)

    reader = SafetensorsReader(tmp_path / "m.safetensors")
    monkeypatch.setattr(st_io, "open_source", lambda *a, **k: Short(opened(*a, **k)))
    assert all(_raw(reader.read(k)) == _raw(t) for k, t in sd.items())
    reader.close()
    name = max(sd, key=lambda k: reader.span(k).offset)  # the last tensor in the file
    os.truncate(tmp_path / "m.safetensors", reader.span(name).offset + 3)
    with pytest.raises(CkptkitError, match=rf"m\.safetensors: unexpected end of file reading '{name}'$"):
        reader.read(name)


@pytest.mark.parametrize("writer", [SafetensorsWriter, TorchPickleWriter])
def test_closing_a_writer_before_every_tensor_is_written_names_the_file_and_the_first_five_missing(
    writer: type, tmp_path: Path
) -> None:
    names = [f"layers.{i}.w" for i in range(8)]
    path = tmp_path / "m"
    args = (None,) if writer is SafetensorsWriter else ()
    w = writer(path, [(n, torch.float32, (2,)) for n in names], *args)
    w.write(names[0], torch.ones(2))
    with pytest.raises(RuntimeError) as e:
        w.close()
    assert str(e.value) == f"{path}: tensors never written: {names[1:6]}"
