"""Fuzzing: mutated real checkpoints through inspect, convert and verify, in-process.

Hypothesis picks a fixture (written by transformers/torch.save, or by ckptkit itself for
the sidecars), one of its files and a mutation: byte flips, overwrites, truncation or
insertion aimed at the structures (safetensors header, zip local headers and central
directory, the pickle), or a structured JSON edit (a value replaced by a wrong type, a
zero, a huge or negative number, a path, deep nesting; a key dropped). Each mutated
checkpoint goes through ``inspect``, ``convert`` (to another format, and back to its own)
and, when the conversion succeeded, ``verify SRC DST``, all through the CLI entry point
in this process. Every run must end in exit 0, or exit 1 with exactly one line on stderr;
never a traceback, a hang (30 s alarm) or any other exit. The source is never modified,
and nothing is left beside DST. A successful conversion must verify equal to its source,
its weight files must load with the safetensors library / ``torch.load(weights_only=True)``,
and a conversion to the source's own format must hold, read that way, what the source
holds read that way (where those libraries can read the mutated source at all).

Two runs: a fixed regression set (derandomized, ``CKPTKIT_FUZZ_EXAMPLES``, default 60, about
a minute on 2 cores) and a random one seeded by ``CKPTKIT_FUZZ_SEED`` (``CKPTKIT_FUZZ_RANDOM_EXAMPLES``,
default 30): the seed is drawn anew for each session unless set, shown in pytest's header
and in any failure, and setting it reproduces the run. For a long run, e.g.
``CKPTKIT_FUZZ_RANDOM_EXAMPLES=5000 python -m pytest tests/convert/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES, FUZZ_SEED, raw_layout, tree_hashes

EXAMPLES = int(os.environ.get("CKPTKIT_FUZZ_EXAMPLES", "60"))
RANDOM_EXAMPLES = int(os.environ.get("CKPTKIT_FUZZ_RANDOM_EXAMPLES", "30"))
SEED = int(os.environ.get(FUZZ_SEED, "0"))  # conftest draws one per session when unset
OTHER = {"hf": "meta", "hf-bin": "hf", "meta": "hf", "internal": "hf-bin"}


@dataclass(frozen=True)
class Seed:
    """A clean checkpoint to mutate and the formats to convert it to."""

    path: Path
    fmt: str


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[Seed]:
    made = tmp_path_factory.mktemp("seeds")
    convert(FIXTURES / "hf/llama2", made / "meta-with-origin", ConvertOptions("meta"))  # ckptkit-origin.json
    convert(FIXTURES / "meta/llama3", made / "internal", ConvertOptions("internal"))  # ckptkit.json
    return [
        Seed(FIXTURES / "hf/llama2", "hf"),
        Seed(FIXTURES / "hf-bin/llama2", "hf-bin"),
        Seed(FIXTURES / "meta/llama2-2rank", "meta"),
        Seed(FIXTURES / "hf/phi3", "hf"),
        Seed(made / "meta-with-origin", "meta"),
        Seed(made / "internal", "internal"),
    ]


# --- mutations ------------------------------------------------------------------------------


def regions(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of a weight file where structure lives (headers, directories, pickle)."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        n = struct.unpack("<Q", data[:8])[0]
        return [(0, 8 + n)]
    try:
        with zipfile.ZipFile(path) as z:
            out = [(z.start_dir, len(data))]
            for zi in z.infolist():
                out.append((zi.header_offset, zi.header_offset + 30 + len(zi.filename)))
                if zi.filename.endswith("data.pkl"):
                    out.append((zi.header_offset, zi.header_offset + 60 + zi.file_size))
            return out
    except zipfile.BadZipFile:
        return [(0, len(data))]


def mutate_bytes(path: Path, data: st.DataObject) -> str:
    raw = bytearray(path.read_bytes())
    lo, hi = data.draw(st.sampled_from(regions(path) + [(0, len(raw))]))
    hi = max(lo + 1, min(hi, len(raw)))
    at = data.draw(st.integers(lo, hi - 1))
    kind = data.draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "zero"]))
    if kind == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "overwrite":
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        raw[at : at + len(chunk)] = chunk
    elif kind == "truncate":
        del raw[at:]
    elif kind == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        raw[at : at + 8] = bytes(min(8, len(raw) - at))
    path.write_bytes(bytes(raw))
    return f"{kind}@{at}"


NASTY = st.one_of(
    st.sampled_from([None, 0, -1, 2.5, True, "", "2", "abc", "../x", "/tmp/x", [], {}, 1e308, 10**30, 100_000_000]),
    st.integers(-(2**70), 2**70),
    st.text(max_size=8),
)


def json_paths(value: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            out += json_paths(v, (*prefix, i))
    return out


def mutate_json(path: Path, data: st.DataObject) -> str:
    text = path.read_text()
    kind = data.draw(st.sampled_from(["value", "drop", "text", "nest", "nonfinite"]))
    if kind == "text":
        raw = bytearray(text.encode())
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        raw[at : at + 1] = data.draw(st.binary(min_size=0, max_size=4))
        path.write_bytes(bytes(raw))
        return f"text@{at}"
    if kind == "nest":
        depth = data.draw(st.sampled_from([65, 1000, 100_000]))
        path.write_text(text.replace("{", '{"deep": ' + "[" * depth + "]" * depth + ",", 1))
        return f"nest{depth}"
    if kind == "nonfinite":
        word = data.draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400"]))
        path.write_text(text.replace(": ", f': {word}, "was": ', 1) if ": " in text else text)
        return f"nonfinite {word}"
    doc = json.loads(text)
    target = data.draw(st.sampled_from(json_paths(doc)[1:] or [()]))
    if not target:
        return "none"
    parent = doc
    for key in target[:-1]:
        parent = parent[key]
    if kind == "drop" and isinstance(parent, dict):
        del parent[target[-1]]
    else:
        parent[target[-1]] = data.draw(NASTY)
    path.write_text(json.dumps(doc))
    return f"{kind} {'/'.join(map(str, target))}"


# --- running and checking ------------------------------------------------------------------


class Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang("no result within 30 s")


def run(*args: str) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr); anything but a clean exit fails the test."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(30)
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        signal.alarm(0)
    shown = f"ckptkit {' '.join(args)}\nexit {result.exit_code}\nstderr:\n{result.stderr}"
    assert not isinstance(result.exception, Hang), shown
    assert result.exit_code in (0, 1), shown
    assert result.exception is None or isinstance(result.exception, SystemExit), f"{shown}\n{result.exception!r}"
    assert "Traceback" not in result.output, shown
    if result.exit_code == 1:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
    return result.exit_code, result.stderr


def beside(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def library_layout(folder: Path) -> dict | None:
    """:func:`conftest.raw_layout` (safetensors library, ``torch.load(weights_only=True)``),
    or None where those libraries refuse the files."""
    try:
        return raw_layout(folder)
    except Exception:  # noqa: BLE001 - any refusal of a mutated file by the libraries
        return None


def convert_and_check(src: Path, dst: Path, to: str, same_format: bool) -> None:
    code, _ = run("convert", str(src), str(dst), "--to", to, "--quiet")
    assert not beside(dst), beside(dst)
    if code == 1:
        assert not dst.exists(), "a failed conversion left DST"
        return
    code, err = run("verify", str(src), str(dst))
    assert code == 0, f"converted but does not verify equal to its source: {err}"
    written = raw_layout(dst)  # loads with safetensors / torch.load, or the test fails
    assert written, "no weight file written"
    source = library_layout(src)
    if same_format and source is not None:
        assert list(written) == list(source), "weight file names differ from the source's"
        for name, tensors in source.items():
            ours = written[name]
            assert [k for k, _ in ours] == [k for k, _ in tensors], f"{name}: names or order differ"
            for (k, a), (_, b) in zip(tensors, ours, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, f"{name}:{k}: dtype or shape differs"
                assert a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)), k


def fuzz_one(seeds: list[Seed], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, where: str) -> None:
    seed = data.draw(st.sampled_from(seeds))
    work = tmp_path_factory.mktemp("fuzz")
    src = work / "src"
    shutil.copytree(seed.path, src)
    files = sorted(p for p in src.iterdir() if p.suffix in (".json", ".safetensors", ".bin", ".pth"))
    target = data.draw(st.sampled_from(files))
    how = mutate_json(target, data) if target.suffix == ".json" else mutate_bytes(target, data)
    note = f"{where}: {seed.path.name}/{target.name}: {how}"
    before = tree_hashes(src)
    try:
        run("inspect", str(src), "--json")
        convert_and_check(src, work / "out", OTHER[seed.fmt], same_format=False)
        convert_and_check(src, work / "same", seed.fmt, same_format=True)
    except AssertionError as e:
        raise AssertionError(f"{note}\n{e}") from None
    assert tree_hashes(src) == before, f"{note}: the source changed"
    shutil.rmtree(work)


SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}


@settings(max_examples=EXAMPLES, derandomize=True, **SETTINGS)
@given(data=st.data())
def test_mutated_checkpoints(seeds: list[Seed], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """The fixed regression set: the same examples every run."""
    fuzz_one(seeds, tmp_path_factory, data, "fixed set")


@hypothesis_seed(SEED)
@settings(max_examples=RANDOM_EXAMPLES, derandomize=False, database=None, **SETTINGS)
@given(data=st.data())
def test_mutated_checkpoints_from_a_random_seed(
    seeds: list[Seed], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """New examples each session; reproduce a failure with the seed its message names."""
    fuzz_one(seeds, tmp_path_factory, data, f"{FUZZ_SEED}={SEED}")
