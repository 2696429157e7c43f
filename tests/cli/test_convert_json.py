"""``convert --json``: one JSON object on stdout and nothing else (no bar, no notes on
stderr): what was written, measured here from DST itself, the seconds, the peak memory the
kernel measured for the process, the verify verdict and the notes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES


def run_json(*args: str) -> tuple[int, str, str, int, float]:
    """(exit status, stdout, stderr, the kernel's peak RSS of the process in bytes, wall seconds)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "ckptkit", "convert", *args, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, err, usage.ru_maxrss * 1024, time.perf_counter() - start


@pytest.mark.parametrize(("to", "name"), [("hf", "out"), ("gguf", "model.gguf")])
def test_convert_json_is_one_object_of_what_was_written(to: str, name: str, tmp_path: Path) -> None:
    src, dst = FIXTURES / "meta" / "llama2", tmp_path / name
    code, out, err, peak, wall = run_json(str(src), str(dst), "--to", to, "--verify")
    assert code == 0 and err == "", err
    assert out.endswith("\n") and out.count("\n") == 1
    doc = json.loads(out)
    files = sorted(p.name for p in dst.iterdir()) if dst.is_dir() else [dst.name]
    assert set(doc) == {"path", "format", "files", "bytes", "seconds", "peak_rss_bytes", "notes", "verify"}
    assert doc["path"] == str(dst) and doc["format"] == to and doc["files"] == files
    assert doc["bytes"] == (sum((dst / f).stat().st_size for f in files) if dst.is_dir() else dst.stat().st_size)
    assert 0 < doc["seconds"] < wall
    assert 0.8 * peak <= doc["peak_rss_bytes"] <= peak  # read before exit: at most what the kernel saw
    reference = convert(src, tmp_path / f"again-{name}", ConvertOptions(to))
    assert doc["notes"] == reference.notes
    assert doc["verify"]["verdict"] == "identical"  # float32 weights: GGUF stores them as they are


def test_convert_json_without_verify_has_no_verdict_and_errors_stay_on_stderr(tmp_path: Path) -> None:
    code, out, err, _, _ = run_json(str(FIXTURES / "hf" / "llama2"), str(tmp_path / "out"), "--to", "meta")
    assert code == 0 and err == "" and "verify" not in json.loads(out)
    code, out, err, _, _ = run_json(str(tmp_path / "missing"), str(tmp_path / "out2"), "--to", "hf")
    assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1
