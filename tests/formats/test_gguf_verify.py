"""``convert --to gguf --verify``: the GGUF is read back and compared with the source before
it is published, as every other target is.

A lossless outtype reads back as the source: each tensor bitwise equal (norms and other 1-D
tensors, which llama.cpp stores as F32, come back in a bf16 file's dtype), or with
``--dtype float32`` the same values widened. A rounding outtype reads
back as the source rounded to each tensor's stored type, and Q8_0 as verify reports it
(values differ in the quantized tensors only); a GGUF that differs otherwise is not published.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptkit.checkpoint import open_checkpoint
from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf import rows
from ckptkit.verify import Report

from conftest import FIXTURES


def _verified(src: Path, dst: Path, dtype: str | None = None) -> Report:
    reports: list[Report] = []
    convert(src, dst, ConvertOptions("gguf", dtype=dtype, verify=True, on_verify=reports.append))
    assert dst.is_file() and len(reports) == 1
    return reports[0]


def _one_dimensional(src: Path) -> set[str]:
    with open_checkpoint(src) as ckpt:
        return {k for k, v in ckpt.tensors.items() if len(v.shape) == 1}


@pytest.mark.parametrize("src", ["hf/llama2", "meta/llama2"])
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_a_lossless_gguf_verifies_as_the_source(src: str, dtype: str | None, tmp_path: Path) -> None:
    report = _verified(FIXTURES / src, tmp_path / "m.gguf", dtype)
    assert not report.only_in_a and not report.only_in_b and report.compared > 0
    assert {d.kind for d in report.differences} <= {"cast"}  # same values, another dtype
    widened = {d.name for d in report.differences}
    if dtype is None:  # bfloat16 source: weights stored BF16, norms F32, read back as BF16 (a bf16 file)
        assert report.ok and not widened and report.identical == report.compared
    else:
        assert report.identical == 0 and len(widened) == report.compared


def test_a_multimodal_release_verifies_with_the_towers_llama_cpp_leaves_out_ignored(tmp_path: Path) -> None:
    report = _verified(FIXTURES / "hf" / "gemma4", tmp_path / "m.gguf")
    assert report.ok and not report.only_in_a and report.identical == report.compared
    assert report.ignored and all(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in report.ignored)


def test_a_rounding_outtype_verifies_as_the_source_rounded(tmp_path: Path) -> None:
    report = _verified(FIXTURES / "hf" / "llama2", tmp_path / "m.gguf", "float16")
    assert not report.only_in_a and not report.only_in_b
    rounded = [d for d in report.differences if d.kind == "rounded"]
    assert rounded and all(d.rounded_to == "float16" for d in rounded)
    assert {d.kind for d in report.differences} == {"cast", "rounded"}


def test_q8_0_is_verified_and_its_verdict_shown(tmp_path: Path) -> None:
    src, dst = FIXTURES / "hf" / "llama2", tmp_path / "m.gguf"
    report = _verified(src, dst, "q8_0")
    flat = _one_dimensional(src)
    quantized = {d.name for d in report.differences if d.kind == "ggml"}
    assert quantized == {k for k in report_names(report) if k not in flat}
    assert {d.ggml_type for d in report.differences if d.kind == "ggml"} == {"Q8_0"}
    assert {d.name for d in report.differences if d.kind == "cast"} == flat
    worst = max(d.max_abs_diff or 0.0 for d in report.differences)
    assert 0 < worst < 2e-3  # measured 3.4e-4: Q8_0's step on these weights
    args = ["convert", src, tmp_path / "cli.gguf", "--to", "gguf", "--dtype", "q8_0", "--verify"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    assert "verified against the source: GGML-QUANTIZED: 0 of 21 tensors bitwise equal, 16 held" in result.stderr


def report_names(report: Report) -> set[str]:
    return {d.name for d in report.differences}


@pytest.mark.parametrize(
    ("byte", "bit"),
    [(3, 0x80), (0, 0x01)],  # the sign of a float32: another value; its last bit: "equal once rounded to bfloat16"
)
def test_a_gguf_that_reads_back_otherwise_is_not_published(
    byte: int, bit: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    encoded = rows._encoded

    def flipped(raw, dtype: str, kind: str, plus_one: bool = False):  # type: ignore[no-untyped-def]
        out = encoded(raw, dtype, kind, plus_one).copy()
        out.reshape(-1)[byte] ^= bit  # in the first value of every chunk
        return out

    monkeypatch.setattr(rows, "_encoded", flipped)
    dst = tmp_path / "m.gguf"
    with pytest.raises(CkptkitError, match=r"m\.gguf: verification failed: .*differ"):
        convert(FIXTURES / "hf" / "llama2", dst, ConvertOptions("gguf", dtype="float32", verify=True))
    assert list(tmp_path.iterdir()) == []


def test_verify_reads_the_written_bytes(tmp_path: Path) -> None:
    """The report compares the GGUF as written: its tensors read back equal the source's values."""
    src, dst = FIXTURES / "hf" / "llama2", tmp_path / "m.gguf"
    _verified(src, dst, "float32")
    with open_checkpoint(src) as a, open_checkpoint(dst) as b:
        for k, t in a.tensors.items():
            assert torch.equal(t.get().float(), b.tensors[k].get()), k


def test_chunks_written_out_of_order_keep_their_bytes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The engine's two workers may finish chunk writes out of order: a chunk whose write is
    held up keeps its bytes while later chunks are made (its buffers are not reused before)."""
    import threading
    import time

    from ckptkit.io import OutputFile

    src = FIXTURES / "hf" / "llama2"
    convert(src, tmp_path / "reference.gguf", ConvertOptions("gguf"))
    monkeypatch.setattr(rows, "CHUNK_BYTES", 4096)  # many chunks per tensor, many in flight
    write, held = OutputFile.write, threading.Event()

    def slow_first(self, data, offset, writeback=True):  # type: ignore[no-untyped-def]
        if memoryview(data).nbytes >= 4096 and not held.is_set():
            held.set()
            time.sleep(0.5)  # the other worker writes the chunks behind this one meanwhile
        return write(self, data, offset, writeback)

    monkeypatch.setattr(OutputFile, "write", slow_first)
    convert(src, tmp_path / "held.gguf", ConvertOptions("gguf"))
    assert held.is_set()
    assert (tmp_path / "held.gguf").read_bytes() == (tmp_path / "reference.gguf").read_bytes()
