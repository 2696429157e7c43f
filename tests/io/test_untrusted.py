"""Untrusted input: every name, offset, size and field read from disk is checked.

Each case builds a damaged copy of a fixture (real files written by torch.save, the
safetensors library and ckptkit itself, then edited at the byte level where a writer would
refuse) and runs the CLI through test_errors' fork driver, with test_errors' contract:
exit 1, one line naming the file and the problem, no traceback, the source untouched,
DST absent, nothing beside it, and no ``pwned`` file (the target of the crafted paths).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from test_errors import INDEX, Case, Evil, Outcome, check, converting, copy_fixture, edit_json, run_in_driver, snapshot

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

CASES: dict[str, Callable[[Path], Case]] = {}


def case(name: str) -> Callable[[Callable[[Path], Case]], Callable[[Path], Case]]:
    def register(build: Callable[[Path], Case]) -> Callable[[Path], Case]:
        CASES[name] = build
        return build

    return register


# --- 1. the recorded layout: tests/io/test_recorded_origin.py (a note, never an error) -----------


# --- 2. safetensors offsets as strict as the library ----------------------------------------


def rewrite_layout(path: Path, move: Callable[[list[dict]], bytes]) -> None:
    """Rewrite a safetensors file's header and data; ``move`` edits the entries (in data
    order) and returns the new data section."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    entries = sorted(({"name": k, **v} for k, v in header.items()), key=lambda e: e["data_offsets"][0])
    data = move(entries, raw[8 + n :])  # type: ignore[call-arg]
    out = {"__metadata__": meta} if meta else {}
    out.update({e.pop("name"): e for e in entries})
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def library_refuses(path: Path) -> None:
    with pytest.raises(SafetensorError):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


@case("safetensors-gap")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / "model-00001-of-00004.safetensors"

    def gap(entries: list[dict], data: bytes) -> bytes:
        cut = entries[0]["data_offsets"][1]
        for e in entries[1:]:
            e["data_offsets"] = [x + 8 for x in e["data_offsets"]]
        return data[:cut] + b"\0" * 8 + data[cut:]

    rewrite_layout(shard, gap)  # type: ignore[arg-type]
    library_refuses(shard)
    return converting(src, tmp, shard.name, "invalid offset", "gap")


@case("safetensors-overlap")
def _(tmp: Path) -> Case:
    src = copy_fixture("hf/llama2", tmp / "src")
    shard = src / "model-00001-of-00004.safetensors"

    def overlap(entries: list[dict], data: bytes) -> bytes:
        entries[-1]["data_offsets"] = [x - 2 for x in entries[-1]["data_offsets"]]  # sizes unchanged
        return data

    rewrite_layout(shard, overlap)  # type: ignore[arg-type]
    library_refuses(shard)
    return converting(src, tmp, shard.name, "invalid offset", "overlaps")


# --- 3. replicated Meta tensors must agree -----------------------------------------------------


@case("meta-ranks-disagree-on-norm")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2-2rank", tmp / "src")
    state = torch.load(src / "consolidated.01.pth", weights_only=True)
    state["norm.weight"] = state["norm.weight"] + 1
    torch.save(state, src / "consolidated.01.pth")
    return converting(src, tmp, "consolidated.00.pth and", "consolidated.01.pth", "norm.weight")


@case("meta-ranks-disagree-through-memory")
def _(tmp: Path) -> Case:
    """The same, with the file-to-file copy off: the tensors go through memory."""
    c = CASES["meta-ranks-disagree-on-norm"](tmp)
    c.args += ["--copy-method", "off"]
    return c


# --- 6. zip members, JSON, config fields, special files ----------------------------------------


BIN = "pytorch_model-00001-of-00002.bin"


def rezip(path: Path, compress: int) -> None:
    with zipfile.ZipFile(path) as z:
        members = [(zi.filename, z.read(zi)) for zi in z.infolist()]
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        for name, data in members:
            z.writestr(name, data)


def patch_central(path: Path, member_suffix: str, edit: Callable[[bytearray, int, int], None]) -> None:
    """Edit the local and central headers of one zip member in place: ``edit(data, at, kind)``
    gets the offset of a header (kind 0: local, 1: central)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        zi = next(i for i in z.infolist() if i.filename.endswith(member_suffix))
        start = z.start_dir
    edit(data, zi.header_offset, 0)
    pos = start
    while data[pos : pos + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        if data[pos + 46 : pos + 46 + n].decode("utf-8", "replace").endswith(member_suffix):
            edit(data, pos, 1)
        pos += 46 + n + m + k
    path.write_bytes(bytes(data))


def set_flag(bit: int, clear: int = 0) -> Callable[[bytearray, int, int], None]:
    def edit(data: bytearray, at: int, kind: int) -> None:
        where = at + (6 if kind == 0 else 8)
        flags = struct.unpack("<H", data[where : where + 2])[0]
        data[where : where + 2] = struct.pack("<H", (flags | bit) & ~clear)

    return edit


def latin_name(data: bytearray, at: int, kind: int) -> None:
    """Make the last letter of the member name a non-UTF-8 byte and clear the UTF-8 flag."""
    set_flag(0, clear=0x800)(data, at, kind)
    n = struct.unpack("<H", data[at + (26 if kind == 0 else 28) : at + (28 if kind == 0 else 30)])[0]
    name_at = at + (30 if kind == 0 else 46)
    data[name_at + n - 1] = 0xE9


def hf_bin(tmp: Path) -> tuple[Path, Path]:
    src = copy_fixture("hf-bin/llama2", tmp / "src")
    return src, src / BIN


@case("zip-deflated")
def _(tmp: Path) -> Case:
    src, path = hf_bin(tmp)
    rezip(path, zipfile.ZIP_DEFLATED)
    return converting(src, tmp, BIN, "compressed", to="hf")


@case("zip-encrypted-flag")
def _(tmp: Path) -> Case:
    src, path = hf_bin(tmp)
    patch_central(path, "/data.pkl", set_flag(0x1))
    return converting(src, tmp, BIN, "encrypted", to="hf")


@case("zip-non-utf8-name")
def _(tmp: Path) -> Case:
    src, path = hf_bin(tmp)
    patch_central(path, "/byteorder", latin_name)
    return converting(src, tmp, BIN, "not a plain UTF-8", to="hf")


@case("zip-crc-mismatch")
def _(tmp: Path) -> Case:
    src, path = hf_bin(tmp)
    with zipfile.ZipFile(path) as z:
        zi = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    n, m = struct.unpack("<HH", data[zi.header_offset + 26 : zi.header_offset + 30])
    data[zi.header_offset + 30 + n + m + zi.file_size // 2] ^= 0x40  # one bit of one weight
    path.write_bytes(bytes(data))
    return converting(src, tmp, BIN, "CRC-32", to="hf")


def llama2_hf(tmp: Path) -> Path:
    return copy_fixture("hf/llama2", tmp / "src")


def raw_json_edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@case("json-infinity")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    raw_json_edit(src / "config.json", '"rope_theta": 10000.0', '"rope_theta": Infinity')
    return converting(src, tmp, "config.json", "Infinity")


@case("json-deep-nesting")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    raw_json_edit(src / "config.json", "{", '{"x": ' + "[" * 100_000 + "]" * 100_000 + ",")
    return converting(src, tmp, "config.json", "nested")


for _name, _value in (("str", "2"), ("float", 2.5), ("null", None), ("zero", 0), ("bool", True)):

    @case(f"config-num_hidden_layers-{_name}")
    def _(tmp: Path, value: object = _value) -> Case:
        src = llama2_hf(tmp)
        edit_json(src / "config.json", num_hidden_layers=value)
        return converting(src, tmp, "config.json", "num_hidden_layers", "positive integer")


@case("config-num_hidden_layers-nan")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    raw_json_edit(src / "config.json", '"num_hidden_layers": 2', '"num_hidden_layers": NaN')
    return converting(src, tmp, "config.json", "NaN")


@case("config-num_hidden_layers-huge")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    edit_json(src / "config.json", num_hidden_layers=100_000_000)
    return converting(src, tmp, "config.json", "100000000", "hold 2 layers")


for _field, _value in (("n_heads", 0), ("multiple_of", 0), ("dim", "abc"), ("n_layers", 2.0)):

    @case(f"params-{_field}-{_value}")
    def _(tmp: Path, field: str = _field, value: object = _value) -> Case:
        src = copy_fixture("meta/llama2", tmp / "src")
        edit_json(src / "params.json", **{field: value})
        return converting(src, tmp, "params.json", repr(field))


@case("index-value-null")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    doc = json.loads((src / INDEX).read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = None
    (src / INDEX).write_text(json.dumps(doc))
    return converting(src, tmp, INDEX, "shard name")


@case("internal-files-not-a-map")
def _(tmp: Path) -> Case:
    src = tmp / "src"
    convert(FIXTURES / "hf/llama2", src, ConvertOptions("internal"))
    edit_json(src / "ckptkit.json", files=["weights.safetensors"])
    return converting(src, tmp, "ckptkit.json", "files", to="hf")


@case("internal-config-field-type")
def _(tmp: Path) -> Case:
    src = tmp / "src"
    convert(FIXTURES / "hf/llama2", src, ConvertOptions("internal"))
    doc = json.loads((src / "ckptkit.json").read_text())
    doc["config"]["num_heads"] = "4"
    (src / "ckptkit.json").write_text(json.dumps(doc))
    return converting(src, tmp, "ckptkit.json", "num_heads", to="hf")


@case("pth-symlink-to-dev-zero")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    (src / "consolidated.00.pth").unlink()
    (src / "consolidated.00.pth").symlink_to("/dev/zero")
    return converting(src, tmp, "consolidated.00.pth", "/dev/zero")


@case("fifo-as-weight-file")
def _(tmp: Path) -> Case:
    src = copy_fixture("meta/llama2", tmp / "src")
    (src / "consolidated.00.pth").unlink()
    os.mkfifo(src / "consolidated.00.pth")  # opening it for reading would block forever
    return converting(src, tmp, "consolidated.00.pth", "FIFO")


@case("fifo-as-shard")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    (src / "model-00004-of-00004.safetensors").unlink()
    os.mkfifo(src / "model-00004-of-00004.safetensors")
    return converting(src, tmp, "model-00004-of-00004.safetensors", "FIFO")


# --- 7. carried files: no symlinks out of SRC, no special files dropped silently ---------------


@case("carried-symlink-outside-src")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    secret = tmp / "secret.txt"
    secret.write_text("not yours\n")
    (src / "tokenizer.model").unlink()
    (src / "tokenizer.model").symlink_to(secret)
    return converting(src, tmp, "tokenizer.model", "outside the checkpoint folder")


@case("carried-fifo")
def _(tmp: Path) -> Case:
    src = llama2_hf(tmp)
    os.mkfifo(src / "notes.txt")
    return converting(src, tmp, "notes.txt", "FIFO")


# --- running them -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    built = {}
    for name, build in CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        built[name] = (tmp, build(tmp))
    before = {n: (snapshot(c.src), snapshot(c.keep)) for n, (_, c) in built.items()}
    procs = run_in_driver(built, tmp_path_factory.mktemp("logs"))
    return {n: Outcome(tmp, c, procs[n], *before[n]) for n, (tmp, c) in built.items()}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the case driver forks")
@pytest.mark.parametrize("name", list(CASES))
def test_untrusted_input(name: str, outcomes: dict[str, Outcome]) -> None:
    check(outcomes[name])


def test_symlinks_inside_src_are_followed(tmp_path: Path) -> None:
    """A symlink that stays inside SRC (or a Hugging Face cache snapshot's blobs) is fine."""
    cache = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    shutil.copytree(FIXTURES / "hf/llama2", cache)
    blobs.mkdir()
    for p in sorted(cache.iterdir()):
        os.rename(p, blobs / p.name)
        p.symlink_to(Path("../../blobs") / p.name)
    convert(cache, tmp_path / "out", ConvertOptions("meta"))
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (blobs / "tokenizer.model").read_bytes()
    assert not (tmp_path / "out" / "tokenizer.model").is_symlink()


def test_replicated_tensors_that_agree_convert(tmp_path: Path) -> None:
    convert(FIXTURES / "meta/llama2-2rank", tmp_path / "out", ConvertOptions("hf"))
    with pytest.raises(CkptkitError, match="exists and is not empty"):
        convert(FIXTURES / "meta/llama2-2rank", tmp_path / "out", ConvertOptions("hf"))


# --- pickles the fast index cannot read: torch.load(weights_only=True) reads them whole ------


def test_a_legacy_pickle_is_read_whole_and_exactly(tmp_path: Path) -> None:
    """A pre-zip torch.save file (no records, no CRC-32s): every tensor, its dtype and
    bytes, and a tensor saved twice under two names as an alias."""
    from ckptkit.formats.torch_io import TorchPickleReader

    a = torch.arange(6.0).reshape(2, 3)
    sd = {"a": a, "b": torch.linspace(-1, 1, 5).to(torch.bfloat16), "tied": a}
    torch.save(sd, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    reader = TorchPickleReader(tmp_path / "old.pth")
    assert reader.aliases == {"tied": "a"} and reader.span("a") is None  # nothing to copy file to file
    assert {k: (i.shape, i.dtype) for k, i in reader.infos.items()} == {
        "a": ((2, 3), "float32"), "b": ((5,), "bfloat16"), "tied": ((2, 3), "float32")
    }  # fmt: skip
    for k, v in sd.items():
        got = reader.read(k)
        assert got.dtype == v.dtype and torch.equal(got, v)
    assert reader.sample("b", 4) == sd["b"].view(torch.uint8).numpy().tobytes()[:4]
    reader.close()
    assert torch.equal(reader.read("a"), a)  # read again after close


def test_a_legacy_pickle_that_is_not_a_state_dict_is_one_line(tmp_path: Path) -> None:
    from ckptkit.formats.torch_io import TorchPickleReader

    torch.save([torch.zeros(2)], tmp_path / "list.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(CkptkitError, match=r": expected a flat dict of tensors \(a state dict\)$"):
        TorchPickleReader(tmp_path / "list.pth")


def test_unreadable_legacy_pickles_are_refused_in_one_line(tmp_path: Path) -> None:
    from ckptkit.formats.torch_io import TorchPickleReader

    def refused(path: Path) -> str:
        with pytest.raises(CkptkitError) as info:
            TorchPickleReader(path)
        assert str(info.value).startswith(f"{path}: ")
        return str(info.value).removeprefix(f"{path}: ")

    torch.save({"x": Evil(tmp_path / "pwned")}, tmp_path / "evil.pth", _use_new_zipfile_serialization=False)
    assert refused(tmp_path / "evil.pth") == (
        "refusing to load: the pickle needs more than weights_only=True allows (it imports posix.system)"
    )
    assert not (tmp_path / "pwned").exists()
    torch.save({"a": torch.zeros(64)}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    data = (tmp_path / "old.pth").read_bytes()
    damaged = {"cut": data[: len(data) // 2], "empty": b"", "garbage": b"\x80\x02not a pickle at all, only words"}
    for name, raw in damaged.items():
        (tmp_path / name).write_bytes(raw)
        assert refused(tmp_path / name) == "not a torch checkpoint (corrupt or not a pickle)", name


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (RuntimeError("The archive is damaged. Nothing more to say.\nsecond line"), "The archive is damaged."),
        (ValueError("x" * 200), "x" * 157 + "..."),
        (ValueError("y" * 160), "y" * 160),
        (ValueError("z" * 161), "z" * 157 + "..."),
        (OSError(), "OSError"),
    ],
)
def test_a_damaged_archive_is_named_by_the_first_sentence_of_torch_s_error(
    error: Exception, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What torch.load says about a damaged file, cut to its first sentence (160 characters at most)."""
    from ckptkit.formats.torch_io import TorchPickleReader

    torch.save({"a": torch.zeros(4)}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(torch, "load", fail)
    with pytest.raises(CkptkitError) as info:
        TorchPickleReader(tmp_path / "old.pth")
    assert str(info.value) == f"{tmp_path / 'old.pth'}: not a readable torch checkpoint ({said})"


# --- safetensors headers, read by ckptkit's own parser: each damage named in one line ---------


def _entry(offsets: object, dtype: object = "F32", shape: object = (2,)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape, "data_offsets": offsets}


ENTRY = "corrupt safetensors header entry for tensor 'w'"
HEADERS = {  # name: (header JSON or raw bytes, data bytes, the message after "PATH: ")
    "not an object": (b"[1]     ", 0, "corrupt safetensors header (does not start with '{')"),
    "a name twice": (b'{"w":1,"w":2}   ', 0, "corrupt safetensors header (the name 'w' appears twice)"),
    "metadata of numbers": (
        {"__metadata__": {"a": 1}},
        0,
        "corrupt safetensors header (__metadata__ must map strings to strings)",
    ),
    "metadata a list": (
        {"__metadata__": ["a"]},
        0,
        "corrupt safetensors header (__metadata__ must map strings to strings)",
    ),
    "an extra field": ({"w": {**_entry([0, 8]), "x": 1}}, 8, ENTRY),
    "an entry not an object": ({"w": [1]}, 8, ENTRY),
    "an unknown dtype": ({"w": _entry([0, 8], "F99")}, 8, ENTRY),
    "a dtype not a string": ({"w": _entry([0, 8], 5)}, 8, ENTRY),
    "a negative dim": ({"w": _entry([0, 8], shape=(-2,))}, 8, ENTRY),
    "a boolean dim": ({"w": _entry([0, 8], shape=[True, 2])}, 8, ENTRY),
    "a shape not a list": ({"w": _entry([0, 8], shape="2")}, 8, ENTRY),
    "three offsets": ({"w": _entry([0, 8, 9])}, 8, ENTRY),
    "a negative offset": ({"w": _entry([-1, 8])}, 8, ENTRY),
    "an offset as text": ({"w": _entry(["0", 8])}, 8, ENTRY),
    "offsets not a list": ({"w": _entry({"a": 1})}, 8, ENTRY),
    "an end before its start": ({"w": _entry([8, 0])}, 8, "invalid offset for tensor 'w' (8..0)"),
    "a gap": (
        {"a": _entry([0, 8]), "b": _entry([12, 20])},
        20,
        "invalid offset for tensor 'b': it leaves a gap of 4 bytes (offsets 12..20)",
    ),
    "an overlap": (
        {"a": _entry([0, 8]), "b": _entry([4, 12])},
        12,
        "invalid offset for tensor 'b': it overlaps the previous tensor (offsets 4..12)",
    ),
    "the wrong size": (
        {"a": _entry([0, 12])},
        12,
        "tensor 'a' has the wrong size: 12 bytes at offsets 0..12, but shape [2] of float32 needs 8",
    ),
    "the wrong size after another tensor": (
        {"a": _entry([0, 8]), "b": _entry([8, 20])},
        20,
        "tensor 'b' has the wrong size: 12 bytes at offsets 8..20, but shape [2] of float32 needs 8",
    ),
    "data left over": (
        {"a": _entry([0, 8])},
        12,
        "the tensors cover 8 bytes but the data section holds 12: the file is truncated or corrupt",
    ),
    "data cut short": (
        {"a": _entry([0, 8])},
        4,
        "the tensors cover 8 bytes but the data section holds 4: the file is truncated or corrupt",
    ),
}


def _safetensors(path: Path, header: dict | bytes, data: int, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data))
    return path


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_damaged_safetensors_header_is_named_in_one_line(case: str, tmp_path: Path) -> None:
    from ckptkit.formats.safetensors_io import SafetensorsReader

    header, data, said = HEADERS[case]
    path = _safetensors(tmp_path / "m.safetensors", header, data)
    with pytest.raises(CkptkitError) as info:
        SafetensorsReader(path)
    assert str(info.value) == f"{path}: {said}"


def test_a_safetensors_length_field_past_the_file_is_named(tmp_path: Path) -> None:
    from ckptkit.formats.safetensors_io import SafetensorsReader

    (tmp_path / "short.safetensors").write_bytes(b"1234")
    with pytest.raises(CkptkitError, match=r"short.safetensors: not a safetensors file \(shorter than 8 bytes\)$"):
        SafetensorsReader(tmp_path / "short.safetensors")
    for length in (10**6, 2**63 + 2):  # the second: negative as a signed 64-bit number
        path = _safetensors(tmp_path / "long.safetensors", {}, 0, length=length)
        with pytest.raises(CkptkitError) as info:
            SafetensorsReader(path)
        said = f"truncated or corrupt safetensors header (header length {length}, file size 10)"
        assert str(info.value) == f"{path}: {said}"


def test_a_safetensors_header_of_exactly_the_limit_is_read_and_one_byte_more_is_refused_unread(
    tmp_path: Path,
) -> None:
    """The safetensors library's 100 MB header limit: a header of that length is parsed (here:
    zeros, not JSON), one byte longer is refused by its length alone (sparse files)."""
    from ckptkit.formats.safetensors_io import MAX_HEADER_BYTES, SafetensorsReader

    for n, said in (
        (MAX_HEADER_BYTES, "corrupt safetensors header (does not start with '{')"),
        (MAX_HEADER_BYTES + 1, f"truncated or corrupt safetensors header (header length {MAX_HEADER_BYTES + 1}, "),
    ):
        path = tmp_path / f"h{n}.safetensors"
        with path.open("wb") as f:
            f.write(struct.pack("<Q", n))
            f.truncate(8 + MAX_HEADER_BYTES + 1)
        with pytest.raises(CkptkitError) as info:
            SafetensorsReader(path)
        assert str(info.value).startswith(f"{path}: {said}")


def test_a_safetensors_header_the_disk_fails_to_read_is_one_line_with_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from ckptkit.formats import safetensors_io

    path = _safetensors(tmp_path / "m.safetensors", {"a": _entry([0, 8])}, 8)

    class Failing:  # a source file whose reads fail as on a failing disk
        def size(self) -> int:
            return path.stat().st_size

        def readinto(self, view: memoryview, offset: int) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def fileno(self) -> None:
            return None

        def close(self) -> None:
            pass

    monkeypatch.setattr(safetensors_io, "open_source", lambda p: Failing())
    with pytest.raises(CkptkitError) as info:
        safetensors_io.SafetensorsReader(path)
    assert str(info.value) == f"{path}: cannot read: {os.strerror(errno.EIO)}"


def test_a_zero_size_tensor_listed_first_at_the_data_s_end_is_fine(tmp_path: Path) -> None:
    """Tensors are placed by their offsets (start, then end), not by the header's order."""
    from ckptkit.formats.safetensors_io import SafetensorsReader

    header = {"z": _entry([8, 8], shape=(0,)), "w": _entry([0, 8])}
    path = _safetensors(tmp_path / "m.safetensors", header, 8)
    reader = SafetensorsReader(path)
    assert reader.read("w").tolist() == [0.0, 0.0] and reader.read("z").numel() == 0


def test_a_global_hidden_behind_an_opcode_the_index_does_not_know_never_runs(tmp_path: Path) -> None:
    """The torch-free index stops at the first opcode outside its subset (here POP) and hands
    the file to torch.load, which must still refuse the os.system call that follows."""
    from ckptkit.formats.torch_io import TorchPickleReader

    torch.save({"w": torch.zeros(2)}, tmp_path / "src.pth")
    cmd = f"touch '{tmp_path / 'pwned'}'".encode()
    pkl = b"\x80\x02N0cposix\nsystem\nX" + struct.pack("<I", len(cmd)) + cmd + b"\x85R."
    with zipfile.ZipFile(tmp_path / "src.pth") as src, zipfile.ZipFile(tmp_path / "evil.pth", "w") as out:
        for zi in src.infolist():
            out.writestr(zi.filename, pkl if zi.filename.endswith("/data.pkl") else src.read(zi))
    with pytest.raises(CkptkitError, match=r"evil\.pth: not a torch checkpoint \(corrupt or not a pickle\)$"):
        TorchPickleReader(tmp_path / "evil.pth")
    assert not (tmp_path / "pwned").exists()


def test_a_weights_only_refusal_that_names_no_global_says_so_without_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from ckptkit.formats.torch_io import TorchPickleReader

    torch.save({"a": torch.zeros(4)}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise pickle.UnpicklingError("Weights only load failed. Unsupported class numpy.dtype")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CkptkitError) as info:
        TorchPickleReader(tmp_path / "old.pth")
    said = "refusing to load: the pickle needs more than weights_only=True allows"
    assert str(info.value) == f"{tmp_path / 'old.pth'}: {said}"
