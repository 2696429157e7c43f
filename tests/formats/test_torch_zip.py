"""The torch-free .pth skeleton is what torch.save writes, byte for byte (but for the random
serialization id), and the writer built on it loads in torch."""

from __future__ import annotations

import errno
import os
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from ckptkit.formats.torch_writer import TorchPickleWriter
from ckptkit.formats.torch_zip import write_skeleton

SERIALIZATION_ID = ".data/serialization_id"  # random in every torch.save archive


def _torch_skeleton(path: Path, entries: list[tuple[str, str, tuple[int, ...]]]) -> None:
    placeholders = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in entries}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.serialization.skip_data():
            torch.save(placeholders, path)


def _regions(path: Path) -> list[bytes]:
    """The file's bytes outside tensor data and the serialization id, with that id's two
    CRC-32 copies (data descriptor, central directory) zeroed."""
    holes = []
    with zipfile.ZipFile(path) as z, path.open("rb") as f:
        for zi in z.infolist():
            if "/data/" in zi.filename or zi.filename.endswith(SERIALIZATION_ID):
                f.seek(zi.header_offset + 26)
                name_len, extra_len = struct.unpack("<HH", f.read(4))
                start = zi.header_offset + 30 + name_len + extra_len
                holes.append((start, start + zi.file_size))
        size = f.seek(0, 2)
        out, pos = [], 0
        for lo, hi in sorted(holes) + [(size, size)]:
            f.seek(pos)
            out.append(bytearray(f.read(lo - pos)))
            pos = hi
    last = out[-1]  # starts right after the serialization id: its data descriptor, then the directory
    last[4:8] = bytes(4)
    name = f"{path.stem}/{SERIALIZATION_ID}".encode()
    central = last.index(name) - 46
    last[central + 16 : central + 20] = bytes(4)
    return [bytes(r) for r in out]


CASES = {
    "small": [("a", "bfloat16", (3, 2)), ("b", "float32", (5,))],
    "odd shapes": [("s", "int64", ()), ("z", "float32", (0,)), ("q", "bfloat16", (2, 3, 4, 5)), ("b", "bool", (3,))],
    "two and three dims (TUPLE2, TUPLE3)": [("m", "float32", (2, 3)), ("e", "bfloat16", (4, 3, 2))],
    "memo past 255": [(f"layers.{i}.w", "float16", (4, 4)) for i in range(300)],
    # a storage type first pickled past memo 255, then fetched from the memo (4-byte index)
    "a dtype first seen past memo 255": [(f"h{i}", "float16", (2,)) for i in range(90)]
    + [("f0", "float32", (2,)), ("f1", "float32", (3,)), ("f2", "float32", (300,))],
    "sizes of 2 and 4 bytes": [("wide", "int8", (300, 70000)), ("tall", "int8", (70000, 3))],
    "a size past 2**31": [("big", "int8", (2**16, 2**15 + 1))],  # placeholders only: no memory touched
    # each integer opcode's edges (K < 256 <= M < 65536 <= J < 2**31 <= LONG1), as sizes and strides
    "integers at the opcode edges": [
        (f"e{n}", "int8", shape)
        for n, shape in enumerate([(255,), (256,), (65535,), (65536,), (2**31 - 1,), (2**31,), (256, 1), (65536, 1)])
    ],
    "a full SETITEMS batch": [(f"t{i}", "float32", (1,)) for i in range(1000)],
    "three SETITEMS batches": [(f"t{i}", "float32", (1,)) for i in range(2500)],
    # 65538 records with data.pkl, byteorder, version and the id: the end record's 16-bit counts say 0xFFFF
    "more records than 16 bits count": [(f"t{i}", "float32", (1,)) for i in range(65532)],
    "one tensor": [("only", "int8", (7, 3))],
    "empty": [],
}


@pytest.mark.parametrize("entries", CASES.values(), ids=CASES.keys())
def test_skeleton_is_what_torch_save_writes(entries, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ours, theirs = tmp_path / "a" / "consolidated.00.pth", tmp_path / "b" / "consolidated.00.pth"
    write_skeleton(ours, entries)
    _torch_skeleton(theirs, entries)
    assert ours.stat().st_size == theirs.stat().st_size
    assert _regions(ours) == _regions(theirs)


@pytest.mark.slow
def test_skeleton_past_4_gib_is_what_torch_save_writes(tmp_path: Path) -> None:
    """zip64 fields for a record over 4 GiB and for headers beyond 4 GiB (sparse files)."""
    entries = [("a", "float32", (70000, 3)), ("big", "bfloat16", (2**31 + 5,)), ("after", "float32", (7,))]
    entries.append(("huge", "int32", (2**20, 1100)))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ours, theirs = tmp_path / "a" / "m.bin", tmp_path / "b" / "m.bin"
    write_skeleton(ours, entries)
    _torch_skeleton(theirs, entries)
    assert _regions(ours) == _regions(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("edge", ["a record of 4 GiB - 1 byte", "a header at 4 GiB - 1 byte"])
def test_skeleton_at_the_zip64_edge_is_what_torch_save_writes(edge: str, tmp_path: Path) -> None:
    """0xFFFFFFFF itself (a size, an offset) already needs zip64, as miniz decides (sparse files)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ours, theirs = tmp_path / "a" / "m.bin", tmp_path / "b" / "m.bin"
    if edge.startswith("a record"):
        entries = [("edge", "int8", (0xFFFFFFFF,)), ("after", "float32", (3,))]
    else:  # the first tensor ends where the second record's header must start at 0xFFFFFFFF
        first = {r.name: r for r in write_skeleton(ours, [("first", "int8", (1,)), ("second", "int8", (5,))])}
        descriptor = 16  # signature, CRC-32 and two 4-byte sizes
        size = 0xFFFFFFFF - descriptor - first["data/0"].data_offset
        entries = [("first", "int8", (size,)), ("second", "int8", (5,))]
    records = {r.name: r for r in write_skeleton(ours, entries)}
    _torch_skeleton(theirs, entries)
    assert 0xFFFFFFFF in (records["data/0"].size, records["data/1"].header_offset)
    assert _regions(ours) == _regions(theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # the second: via torch.save
def test_writer_output_loads_in_torch(dtype: torch.dtype, tmp_path: Path) -> None:
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype), "n": torch.ones(4)}
    w = TorchPickleWriter(tmp_path / "m.pth", [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()])
    for k, v in sd.items():
        w.write(k, v)
    w.close()
    loaded = torch.load(tmp_path / "m.pth", weights_only=True, mmap=True)
    assert list(loaded) == list(sd)
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in sd.items())
    with zipfile.ZipFile(tmp_path / "m.pth") as z:
        assert z.testzip() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # the second: via torch.save
@pytest.mark.parametrize("archive", ["m", "renamed_after_save"])
def test_writer_given_the_source_archive_facts_writes_torch_save_bytes(
    dtype: torch.dtype, archive: str, tmp_path: Path
) -> None:
    """Tensor bytes, CRC-32s (in the data descriptors, as torch writes them: the local
    headers keep 0), archive folder name and serialization id: the whole file is torch's."""
    from ckptkit.formats.pickle_index import archive_facts

    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype), "n": torch.ones(4)}
    (tmp_path / "t").mkdir()
    torch.save(sd, tmp_path / "t" / f"{archive}.pth")
    theirs = tmp_path / "m.pth"
    (tmp_path / "t" / f"{archive}.pth").rename(theirs)
    facts = archive_facts(theirs)
    assert facts is not None and facts["archive"] == archive and len(facts["serialization_id"]) == 40
    ours = tmp_path / "out" / "m.pth"
    ours.parent.mkdir()
    w = TorchPickleWriter(ours, [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()], facts=facts)
    for k, v in sd.items():
        w.write(k, v)
    w.close()
    assert ours.read_bytes() == theirs.read_bytes()
    assert sorted(p.name for p in ours.parent.iterdir()) == ["m.pth"]  # no staging folder left


def test_a_failed_torch_save_is_an_oserror_with_the_real_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save reports a failed write as a RuntimeError; save_torch finds the errno
    (here the file size limit, as a full disk would give ENOSPC) or says EIO with torch's words."""
    import resource
    import signal

    from ckptkit.formats.torch_writer import save_torch

    path = tmp_path / "x.pth"
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(OSError) as limited:
            save_torch({"w": torch.zeros(50_000)}, path, size_hint=10)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert limited.value.errno == errno.EFBIG and limited.value.filename == str(path)
    assert limited.value.strerror == os.strerror(errno.EFBIG)

    def refuse(*args: object, **kwargs: object) -> None:
        path.write_bytes(b"")
        raise RuntimeError("  PytorchStreamWriter failed writing file data/0\nmore detail  ")

    monkeypatch.setattr(torch, "save", refuse)
    with pytest.raises(OSError) as failed:
        save_torch({"w": torch.zeros(4)}, path, size_hint=4096)
    assert failed.value.errno == errno.EIO and failed.value.filename == str(path)
    assert failed.value.strerror == "torch.save failed (PytorchStreamWriter failed writing file data/0)"
    assert path.stat().st_size == 4097  # the probe byte went where the file would have ended

    for message, said in (("  ", "write failed"), ("x" * 300, "x" * 120)):  # an empty message, a long one

        def refuse_with(*args: object, message: str = message, **kwargs: object) -> None:
            path.write_bytes(b"")
            raise RuntimeError(message)

        monkeypatch.setattr(torch, "save", refuse_with)
        with pytest.raises(OSError) as failed:
            save_torch({"w": torch.zeros(4)}, path)
        assert failed.value.errno == errno.EIO and failed.value.strerror == f"torch.save failed ({said})"
        assert path.stat().st_size == 1  # no size hint: the probe byte at the end of what was written


def test_tied_weights_in_an_archive_named_after_another_file_are_torch_save_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One storage under two names (written through torch.save's placeholders) in an archive
    folder named after the source file: torch's bytes, staged inside the destination folder
    (never the system temp folder, which may be another filesystem: here it does not exist)."""
    import tempfile

    from ckptkit.formats.pickle_index import archive_facts

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd = {"embed": w, "lm_head": w, "norm": torch.ones(4)}
    (tmp_path / "t").mkdir()
    torch.save(sd, tmp_path / "t" / "original.pth")
    theirs = tmp_path / "m.pth"
    (tmp_path / "t" / "original.pth").rename(theirs)
    facts = archive_facts(theirs)
    assert facts is not None and facts["archive"] == "original"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    ours = tmp_path / "out" / "m.pth"
    ours.parent.mkdir()
    writer = TorchPickleWriter(
        ours, [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()], aliases={"lm_head": "embed"}, facts=facts
    )
    for k, v in sd.items():
        writer.write(k, v)
    writer.close()
    assert ours.read_bytes() == theirs.read_bytes()
    assert sorted(p.name for p in ours.parent.iterdir()) == ["m.pth"]
    loaded = torch.load(ours, weights_only=True)
    assert loaded["lm_head"].untyped_storage().data_ptr() == loaded["embed"].untyped_storage().data_ptr()


def test_a_failed_save_of_torch_s_placeholders_is_an_oserror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's torch.save route (tied weights) reports a failed write like save_torch does;
    the probe byte goes where the whole file would have ended (the placeholders' bytes)."""

    def refuse(obj: object, path: Path, *args: object, **kwargs: object) -> None:
        Path(path).write_bytes(b"")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0")

    monkeypatch.setattr(torch, "save", refuse)
    entries = [("embed", torch.float32, (3, 4)), ("lm_head", torch.float32, (3, 4)), ("norm", torch.float32, (4,))]
    with pytest.raises(OSError) as failed:
        TorchPickleWriter(tmp_path / "m.pth", entries, aliases={"lm_head": "embed"})
    assert failed.value.errno == errno.EIO and (tmp_path / "m.pth").stat().st_size == 3 * 4 * 4 * 2 + 4 * 4 + 1


@pytest.mark.parametrize(
    ("dtypes", "via_torch"),
    [(["float32", "bfloat16", "int64"], False), (["float8_e4m3fn"], True), (["float8_e5m2", "float32"], True)],
)
def test_the_skeleton_is_written_without_torch_save_exactly_when_every_dtype_has_a_storage_name(
    dtypes: list[str], via_torch: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save (slow, in memory) writes the skeleton only for dtypes the torch-free pickle
    cannot name (float8): the others never reach it, and both give a file torch loads."""
    import ckptkit.formats.torch_writer as torch_writer

    calls: list[list[str]] = []
    skeleton = torch_writer._torch_skeleton

    def spy(path: Path, named: list[tuple[str, str, tuple[int, ...]]], *args: object) -> object:
        calls.append([d for _, d, _ in named])
        return skeleton(path, named, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_writer, "_torch_skeleton", spy)
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sd = {f"t{i}": base.to(getattr(torch, d)) for i, d in enumerate(dtypes)}
    w = TorchPickleWriter(tmp_path / "m.pth", [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()])
    for k, v in sd.items():
        w.write(k, v)
    w.close()
    assert calls == ([dtypes] if via_torch else [])
    loaded = torch.load(tmp_path / "m.pth", weights_only=True)
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in sd.items())
