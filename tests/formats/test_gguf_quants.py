"""GGUF tensor bytes written without torch are the ``gguf`` package's bytes.

The reference is ``gguf.quants.quantize`` (what llama.cpp's converter calls) on the float32
cast of the whole tensor; the torch path (``quantized_chunks``), itself checked against
llama.cpp's converter in ``test_gguf.py``, is the reference for Q/K-permuted rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats.gguf import quants, rows
from ckptkit.io import RecordCheck, Span
from ckptkit.tensors.lazy import Lazy

from conftest import FIXTURES


def reference_q8_0(x: np.ndarray) -> bytes:
    from gguf import GGMLQuantizationType
    from gguf import quants as ref

    with np.errstate(all="ignore"):
        return bytes(ref.quantize(x.astype(np.float32), GGMLQuantizationType.Q8_0).tobytes())


def ours_q8_0(x: np.ndarray) -> bytes:
    with np.errstate(all="ignore"):
        return bytes(quants.quantize_q8_0(x.reshape(-1, 32)).tobytes())


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([32, 64, 96])), elements=st.floats(width=32)))
def test_q8_0_of_any_float32_rows_is_the_gguf_package_quantization(x: np.ndarray) -> None:
    """Any float32 values: NaNs, infinities, subnormals, zeros, huge and tiny blocks."""
    assert ours_q8_0(x) == reference_q8_0(x)


@pytest.mark.parametrize("scale", [0.0, 1e-45, 1e-40, 1e-38, 3e-39, 0.02, 1.0, 1e30, 3.4e38])
def test_q8_0_of_blocks_at_any_scale_is_the_gguf_package_quantization(scale: float) -> None:
    """Whole blocks of zeros, of subnormals (a scale whose inverse overflows), and near the
    float32 limits, in runs longer than one pass of the quantizer."""
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal((quants.Q8_BLOCKS + 7, 32)) * scale).astype(np.float32)
    x[3] = 0
    x[5] = -0.0
    assert ours_q8_0(x) == reference_q8_0(x)


def test_q8_0_rounds_every_float_in_four_binades_and_every_tie_half_away_from_zero() -> None:
    """A block holding 127 has scale 1: its other 31 values are rounded as they are. Every
    float32 in [0.25, 4) of both signs, and each k + 0.5 (k < 127) with its neighbours."""
    lo, hi = np.array([0.25, 4.0], np.float32).view(np.uint32)
    values = np.arange(lo, hi, dtype=np.uint32).view(np.float32)
    ties = np.arange(127, dtype=np.float32) + np.float32(0.5)
    near = np.concatenate([ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(200))])
    values = np.concatenate([values, -values, near, -near])
    values = np.concatenate([values, np.zeros(-len(values) % 31, np.float32)]).reshape(-1, 31)
    x = np.concatenate([np.full((len(values), 1), 127, np.float32), values], axis=1)
    assert ours_q8_0(x) == reference_q8_0(x)


@pytest.mark.parametrize("threads", [2, 4])
def test_q8_0_split_over_threads_is_the_gguf_package_quantization(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past two runs of blocks the quantization is shared with worker threads; every part,
    including one holding NaN, inf and all-zero blocks (the package's own code), gives the
    package's bytes, and the workers did run."""
    monkeypatch.setattr(quants._WORKERS, "_count", threads - 1)
    monkeypatch.setattr(quants._WORKERS, "_pool", None)
    n = 2 * quants.Q8_BLOCKS + 37
    x = np.random.default_rng(4).standard_normal((n, 32)).astype(np.float32)
    x[n - 5, 3], x[n - 9, 0], x[n - 20] = np.nan, np.inf, 0
    ours = quants.quantize_q8_0(x)
    assert quants._WORKERS._pool is not None  # started: the split happened
    assert ours.tobytes() == reference_q8_0(x)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # the same values as bfloat16 bits
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    assert quants.quantize_q8_0(bits, bf16=True).tobytes() == reference_q8_0(widened)


def test_q8_0_of_float16_and_bfloat16_blocks_is_that_of_their_float32_cast() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    half = bits.view(np.float16)
    assert ours_q8_0(half) == reference_q8_0(half.astype(np.float32))
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(all="ignore"):
        ours = quants.quantize_q8_0(bits.reshape(-1, 32), bf16=True).tobytes()
    assert ours == reference_q8_0(widened)


def lazy_in_file(path: Path, data: np.ndarray, dtype: str) -> Lazy:
    path.write_bytes(data.tobytes())
    return Lazy(tuple(data.shape), dtype, lambda: None, spans=lambda: [Span(path, 0, data.nbytes)])  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("kind", ["BF16", "F32", "Q8_0"])
def test_every_bfloat16_pattern_streamed_is_the_gguf_package_bytes_of_its_float32_cast(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BF16 keeps the bits but quiets NaNs as the package's rounding does (NaNs looked for 96
    values at a time: past the first 96 of a chunk too); F32 widens."""
    from gguf import GGMLQuantizationType
    from gguf import quants as ref

    monkeypatch.setattr(rows, "CHUNK_BYTES", 256 * 2 * 5)  # five rows at a time
    monkeypatch.setattr(rows, "NAN_SCAN", 96)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    chunks = rows.row_chunks(lazy_in_file(tmp_path / "t", bits, "bfloat16"), kind, None)
    assert chunks is not None
    with np.errstate(all="ignore"):
        ours = b"".join(bytes(c) for c in chunks)
        widened = (bits.astype(np.uint32) << 16).view(np.float32)
        assert ours == ref.quantize(widened, GGMLQuantizationType[kind]).tobytes()


@pytest.mark.parametrize(("dtype", "kind"), [("float16", "F16"), ("float16", "F32"), ("float32", "F32")])
def test_float16_and_float32_rows_streamed_are_the_gguf_package_bytes(
    dtype: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gguf import GGMLQuantizationType
    from gguf import quants as ref

    monkeypatch.setattr(rows, "CHUNK_BYTES", 4096)
    raw = np.random.default_rng(1).integers(0, 1 << 16, (64, 96), dtype=np.uint32).astype(np.uint16)
    data = raw.view(np.float16) if dtype == "float16" else raw.astype(np.uint32).view(np.float32) * 3
    chunks = rows.row_chunks(lazy_in_file(tmp_path / "t", data, dtype), kind, None)
    assert chunks is not None
    with np.errstate(all="ignore"):
        assert b"".join(bytes(c) for c in chunks) == ref.quantize(data, GGMLQuantizationType[kind]).tobytes()


@pytest.mark.parametrize("kind", ["BF16", "Q8_0"])
@pytest.mark.parametrize("heads", [1, 4, 8])
def test_q_k_rows_permuted_in_chunks_are_the_torch_permutation(
    heads: int, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from gguf import GGMLQuantizationType

    from ckptkit.formats.gguf.tensors import permute

    monkeypatch.setattr(rows, "CHUNK_BYTES", 3 * 16 * 64 * 2)  # not a whole number of heads
    bits = np.random.default_rng(2).integers(0, 1 << 16, (128, 64), dtype=np.uint32).astype(np.uint16) & 0x3FFF
    one = lazy_in_file(tmp_path / "one", bits, "bfloat16")
    # the same rows split over two files: permuted in memory all the same, read across the files
    (tmp_path / "a").write_bytes(bits[:64].tobytes())
    (tmp_path / "b").write_bytes(bits[64:].tobytes())
    halves = [Span(tmp_path / "a", 0, 64 * 128), Span(tmp_path / "b", 0, 64 * 128)]
    two = Lazy(one.shape, "bfloat16", one.get, spans=lambda: halves)
    expected = permute(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), heads, None)
    want = b"".join(quants.quantized_chunks(expected, GGMLQuantizationType[kind]))
    for lazy in (one, two):
        chunks = rows.row_chunks(lazy, kind, heads)
        assert chunks is not None
        assert b"".join(bytes(c) for c in chunks) == want


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0", None])
def test_hf_and_meta_to_gguf_without_torch_equal_the_torch_path(
    dtype: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole file, from HF and from Meta (rows of a .pth), with and without the streamed
    rows; the streamed rows write most tensors where no narrowing cast is asked for."""
    from ckptkit.formats.gguf import writer

    for src in (FIXTURES / "hf" / "llama2", FIXTURES / "meta" / "llama2"):
        name = src.parent.name
        streamed: list[bool] = []

        def counted(*args: object, streamed: list[bool] = streamed) -> object:
            chunks = rows.row_chunks(*args)  # type: ignore[arg-type]
            streamed.append(chunks is not None)
            return chunks

        with monkeypatch.context() as m:
            m.setattr(writer, "row_chunks", counted)
            convert(
                src,
                tmp_path / f"{name}-rows.gguf",
                ConvertOptions("gguf", dtype=dtype, allow_lossy_cast=dtype is not None),
            )
        if dtype in ("float32", "q8_0"):  # the fixtures are float32: narrowing casts go through torch
            assert sum(streamed) > len(streamed) // 2
        with monkeypatch.context() as m:
            m.setattr(writer, "row_chunks", lambda *a: None)
            convert(
                src,
                tmp_path / f"{name}-torch.gguf",
                ConvertOptions("gguf", dtype=dtype, allow_lossy_cast=dtype is not None),
            )
        assert (tmp_path / f"{name}-rows.gguf").read_bytes() == (tmp_path / f"{name}-torch.gguf").read_bytes()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_chunks_written_by_a_lagging_worker_keep_their_bytes_until_written(
    in_flight: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish writes chunks on a worker thread while the next is read and converted: a
    chunk's buffer (the read buffer itself for the bfloat16 fixtures' rows written as BF16,
    the permuted rows' buffer for HF's Q/K) is not read into again before its write, however
    late the write comes and however many writes are in flight."""
    import time

    from ckptkit.formats.gguf import writer

    real = writer.write_then

    def late(*args: object) -> None:
        time.sleep(0.002)  # the main thread makes the next chunks meanwhile
        real(*args)  # type: ignore[arg-type]

    for src in (FIXTURES / "hf" / "llama2", FIXTURES / "meta" / "llama2"):
        name = src.parent.name
        with monkeypatch.context() as m:
            m.setattr(writer, "row_chunks", lambda *a: None)  # the torch path: the reference
            convert(src, tmp_path / f"{name}-torch.gguf", ConvertOptions("gguf", dtype="bfloat16"))
        with monkeypatch.context() as m:
            m.setattr(rows, "CHUNK_BYTES", 512)  # several chunks a tensor
            m.setattr(writer, "write_then", late)
            m.setattr(writer, "DEPTH", in_flight)  # chunk buffer sets: writes in flight + 1
            convert(src, tmp_path / f"{name}-late.gguf", ConvertOptions("gguf", dtype="bfloat16"))
        assert (tmp_path / f"{name}-late.gguf").read_bytes() == (tmp_path / f"{name}-torch.gguf").read_bytes()


@pytest.mark.parametrize("in_flight", [1, 4])
def test_dequantized_pieces_written_by_a_lagging_worker_are_the_whole_tensors_bytes(
    in_flight: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 source's weights go to a BF16 GGUF a dequantized piece at a time, Q/K rows
    permuted by whole heads (pieces of 3 rows end inside the fixture's heads of 10: carried
    over), each piece kept until its write is done however late it comes: the bytes of
    dequantizing each tensor whole (the path test_gguf_fp8 checks against llama.cpp)."""
    import time

    from ckptkit.formats.gguf import in_flight as flight
    from ckptkit.formats.gguf import writer
    from ckptkit.quant import scaled

    src = FIXTURES / "fp8" / "llama-overhang"
    opts = ConvertOptions("gguf", dtype="bfloat16", gguf_pre="llama-bpe")
    with monkeypatch.context() as m:
        m.setattr(writer, "streamed", lambda t: None)  # each tensor dequantized whole
        convert(src, tmp_path / "whole.gguf", opts)
    streamed = []
    write_then = flight.write_then

    def lagging(real: Callable[..., None]) -> Callable[..., None]:
        def late(*args: object) -> None:
            time.sleep(0.002)  # the main thread makes the next pieces meanwhile
            real(*args)

        return late

    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 40)  # a row of the fixture's 40 columns
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 120)  # 3 rows
    monkeypatch.setattr(scaled, "ALIGN", 2)  # each piece where the one two before it lay (not placed by page)
    monkeypatch.setattr(flight, "write_then", lagging(write_then))
    monkeypatch.setattr(writer, "DEPTH", in_flight)
    monkeypatch.setattr(writer, "piece_jobs", lambda *a: streamed.append(a[1].name) or flight.piece_jobs(*a))
    convert(src, tmp_path / "pieces.gguf", opts)
    assert {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"} <= set(streamed), streamed
    assert (tmp_path / "pieces.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


@pytest.mark.parametrize("name", ["llama2", "llama3-2rank"])
def test_meta_q_and_k_go_to_gguf_as_stored_without_a_span_per_row(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's Q/K permutation of Meta's wq/wk seen in HF's layout is the tensor as
    stored: row_chunks composes the two row orders before any span is made (a span per row
    cost milliseconds per tensor) and reads one span per rank, whose bytes are Meta's."""
    import torch
    from gguf import GGMLQuantizationType

    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.formats.gguf.tensors import hf_hparams, model_tensors
    from ckptkit.tensors import transforms

    src = FIXTURES / "meta" / name
    ranks = sorted(src.glob("consolidated.*.pth"))
    stored = [torch.load(r, map_location="cpu", weights_only=True) for r in ranks]
    most = [0]  # the most spans any take_rows call made or was given
    read: list[list[Span]] = []
    real_take, real_chunks = transforms.take_rows, rows._chunks

    def counted(spans: list[Span], row_bytes: int, order: object) -> list[Span]:
        got = real_take(spans, row_bytes, order)  # type: ignore[arg-type]
        most[0] = max(most[0], len(spans), len(got))
        return got

    def seen(spans: list[Span], *args: object) -> object:
        read.append(spans)
        return real_chunks(spans, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(transforms, "take_rows", counted)
    monkeypatch.setattr(rows, "_chunks", seen)
    with open_checkpoint(src, None, None, None) as ckpt:
        tensors, _ = model_tensors(ckpt, hf_hparams(ckpt), "bfloat16")
        qk = [t for t in tensors if t.heads is not None]
        assert len(qk) == 2 * ckpt.config.num_layers
        for t in qk:
            assert t.source is not None
            chunks = rows.row_chunks(t.source, GGMLQuantizationType(t.qtype).name, t.heads)
            assert chunks is not None
            got = b"".join(bytes(c) for c in chunks)
            assert len(read[-1]) == len(ranks)
            layer, which = t.name.split(".")[1], {"attn_q": "wq", "attn_k": "wk"}[t.name.split(".")[2]]
            meta = torch.cat([s[f"layers.{layer}.attention.{which}.weight"] for s in stored]).contiguous()
            assert meta.dtype == torch.bfloat16 and got == meta.view(torch.uint8).numpy().tobytes()
    assert 0 < most[0] <= len(ranks)  # rows were taken, and no span was made per row


@pytest.mark.parametrize("dtype", ["float32", "q8_0"])
def test_a_meta_record_whose_bytes_fail_its_crc_writes_no_gguf(dtype: str, tmp_path: Path) -> None:
    """The streamed rows check each .pth record's CRC-32 as they read it: a flipped byte in
    the middle of a tensor is one error, and no GGUF."""
    import shutil
    import zipfile

    from ckptkit.errors import CkptkitError

    src = tmp_path / "meta"
    shutil.copytree(FIXTURES / "meta" / "llama2", src)
    pth = src / "consolidated.00.pth"
    with zipfile.ZipFile(pth) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with pth.open("r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CkptkitError, match="CRC|corrupt"):
        convert(src, tmp_path / "out.gguf", ConvertOptions("gguf", dtype=dtype))
    assert not (tmp_path / "out.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta"]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.sampled_from([1, 3, 8]), st.data())
def test_rows_of_one_span_are_its_byte_ranges_coalesced(nrows: int, row_bytes: int, data: st.DataObject) -> None:
    """take_rows' shortcut for a tensor stored whole (Q/K rows of a Meta .pth) gives the rows'
    byte ranges in order, neighbours merged, and refuses a row outside the span."""
    from ckptkit.io import coalesce, take_ranges, take_rows

    span = Span(Path("/x"), data.draw(st.integers(0, 100)), nrows * row_bytes)
    wanted = data.draw(st.lists(st.integers(0, nrows - 1), max_size=15)) if nrows else []
    expected = [
        (s.path, s.offset, s.nbytes)
        for s in coalesce(take_ranges([span], ((r * row_bytes, row_bytes) for r in wanted)))
    ]
    assert [(s.path, s.offset, s.nbytes) for s in take_rows([span], row_bytes, wanted)] == expected
    with pytest.raises(ValueError):
        take_rows([span], row_bytes, [nrows])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.sampled_from([1, 3, 8]), st.booleans(), st.data())
def test_rows_of_several_spans_are_their_byte_ranges_coalesced(
    nrows: int, row_bytes: int, whole_rows: bool, data: st.DataObject
) -> None:
    """take_rows over a tensor in several spans (a Meta Q/K already reordered by rows, or
    split over files) gives the rows' byte ranges in order, neighbours merged, whether the
    spans end on row boundaries (rows indexed) or not (ranges cut), and refuses a row
    outside the tensor, negative ones included."""
    from ckptkit.io import coalesce, take_ranges, take_rows

    total = nrows * row_bytes
    step = row_bytes if whole_rows else 1
    cuts = sorted(set(data.draw(st.lists(st.integers(1, total // step - 1), max_size=6)) if total // step > 1 else []))
    bounds = [0, *(c * step for c in cuts), total]
    files = [Path(f"/f{data.draw(st.integers(0, 1))}") for _ in bounds[1:]]
    # spans end to end or apart in their file, in one zip record or another (or none): rows
    # join across spans only where both hold
    records = [None, *(RecordCheck(None, f"data/{k}", 0, 0, k) for k in range(2))]  # type: ignore[arg-type]
    gaps = [data.draw(st.sampled_from([0, 1000])) for _ in files]
    checks = [data.draw(st.sampled_from(records)) for _ in files]
    spans = [
        Span(f, sum(gaps[: i + 1]) + a, b - a, check=c)
        for i, (f, a, b, c) in enumerate(zip(files, bounds, bounds[1:], checks, strict=False))
    ]
    wanted = data.draw(st.lists(st.integers(0, nrows - 1), max_size=15))
    ranges = ((r * row_bytes, row_bytes) for r in wanted)
    expected = [(s.path, s.offset, s.nbytes, s.check) for s in coalesce(take_ranges(spans, ranges))]
    assert [(s.path, s.offset, s.nbytes, s.check) for s in take_rows(spans, row_bytes, wanted)] == expected
    for outside in ([nrows], [-1], [0, -1]):
        with pytest.raises(ValueError):
            take_rows(spans, row_bytes, outside)


def checked_lazy(path: Path, data: np.ndarray, dtype: str, crc: int | None = None) -> Lazy:
    """``data`` in a file that is one zip record's bytes with a recorded CRC-32 (``crc``, or the true one)."""
    import zlib

    from ckptkit.errors import CkptkitError
    from ckptkit.io import RecordCheck, Verifier

    raw = data.tobytes()
    path.write_bytes(raw)
    verifier = Verifier(path, lambda key: CkptkitError(f"{path}: record {key} fails its CRC-32"))
    check = RecordCheck(verifier, "0", 0, len(raw), zlib.crc32(raw) if crc is None else crc)
    return Lazy(tuple(data.shape), dtype, lambda: None, spans=lambda: [Span(path, 0, len(raw), check=check)])  # type: ignore[arg-type,return-value]


def test_record_crcs_are_checked_on_the_bytes_as_read_before_they_are_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CRC-32 of a .pth record read by rows is fed the bytes as read, before they are
    converted: BF16 quiets signalling NaNs in what it writes, never in the read buffer (that
    would fail a sound record), and the output is the package's bytes."""
    from gguf import GGMLQuantizationType
    from gguf import quants as ref

    from ckptkit.io import Verifier

    fed: list[bytes] = []
    feed = Verifier.feed

    def seen(self: Verifier, check: RecordCheck, lo: int, view: memoryview) -> None:
        fed.append(bytes(view))
        feed(self, check, lo, view)

    monkeypatch.setattr(Verifier, "feed", seen)
    monkeypatch.setattr(rows, "CHUNK_BYTES", 256 * 2 * 16)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)  # every pattern, NaNs too
    chunks = rows.row_chunks(checked_lazy(tmp_path / "t", bits, "bfloat16"), "BF16", None)
    assert chunks is not None
    with np.errstate(all="ignore"):
        ours = b"".join(bytes(c) for c in chunks)
        widened = (bits.astype(np.uint32) << 16).view(np.float32)
        assert ours == ref.quantize(widened, GGMLQuantizationType.BF16).tobytes()
    assert len(fed) == 16 and b"".join(fed) == bits.tobytes() != ours  # in read order, as read


def test_a_record_crc_mismatch_is_raised_as_its_last_bytes_are_read_and_an_abandoned_read_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.errors import CkptkitError
    from ckptkit.io import SpanReader

    monkeypatch.setattr(rows, "CHUNK_BYTES", 64 * 4 * 4)
    data = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    chunks = rows.row_chunks(checked_lazy(tmp_path / "t", data, "float32", crc=1), "F32", None)
    assert chunks is not None
    got = []
    with pytest.raises(CkptkitError, match="fails its CRC-32"):
        for c in chunks:
            got.append(bytes(c))
    assert len(got) == 15  # the 16th chunk, the record's end, never came
    lazy = checked_lazy(tmp_path / "u", data, "float32", crc=1)
    spans = lazy.spans()
    assert spans is not None
    half = [spans[0].slice(0, data.nbytes // 2)]
    reader = SpanReader()
    buf = bytearray(data.nbytes // 2)
    reader.read_into(half, memoryview(buf))
    reader.close(check=False)  # abandoned (the write failed): no CRC verdict
    assert bytes(buf) == data.tobytes()[: data.nbytes // 2]
    reader = SpanReader()
    reader.read_into(half, memoryview(buf))
    with pytest.raises(CkptkitError, match="fails its CRC-32"):
        reader.close()  # the rest of the record read to check it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["hf", "meta"])
def test_a_gguf_written_past_the_page_cache_is_the_same_file(
    dtype: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the dirty limit the whole pages of each chunk go O_DIRECT (the edges buffered);
    rows written as stored (the bfloat16 fixtures as BF16) go from the buffer they were
    read into, placed in memory as their pages are in the file: never through the staging
    copy."""
    from ckptkit import writing
    from ckptkit.io import direct as directio

    monkeypatch.setattr(rows, "CHUNK_BYTES", 10_000)  # chunks ending off page boundaries
    monkeypatch.setattr(directio, "MIN_DIRECT", 2 * directio.ALIGN)  # the fixtures' tensors are small
    src = FIXTURES / name / "llama2"
    convert(src, tmp_path / "cached.gguf", ConvertOptions("gguf", dtype=dtype))
    staged, went_direct = [], []
    staging, write_direct = directio.staging, directio._write_direct
    monkeypatch.setattr(directio, "staging", lambda: staged.append(1) or staging())
    monkeypatch.setattr(directio, "_write_direct", lambda *a: went_direct.append(1) or write_direct(*a))
    monkeypatch.setattr(writing, "direct_pays", lambda nbytes, made=0: True)
    convert(src, tmp_path / "direct.gguf", ConvertOptions("gguf", dtype=dtype))
    assert (tmp_path / "direct.gguf").read_bytes() == (tmp_path / "cached.gguf").read_bytes()
    assert went_direct and (staged if dtype == "float32" else not staged)  # widened: new arrays, staged
