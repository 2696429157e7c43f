"""Options that contradict each other, the target format or the files are refused before
anything is read or written, in one line naming the option and what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats import REGISTRY

from conftest import FIXTURES

RANKED = [name for name, fmt in REGISTRY.items() if fmt.info.sharding == "ranks"]

CASES = {
    "max-shard-size for meta": (
        ["meta/llama3", "--to", "meta", "--max-shard-size", "1GB"],
        "--max-shard-size applies to --to hf, hf-bin, internal, not --to meta (model-parallel ranks); "
        "split it with --shards N",
    ),
    "shards for hf": (
        ["hf/llama2", "--to", "hf", "--shards", "2"],
        f"--shards (model-parallel ranks) applies to --to {', '.join(RANKED)}, not --to hf; "
        "limit shard size with --max-shard-size SIZE",
    ),
    "shards for hf-bin": (["hf/llama2", "--to", "hf-bin", "--shards", "2"], "not --to hf-bin"),
    "lossy cast without a cast": (
        ["hf/llama2", "--to", "hf", "--allow-lossy-cast"],
        "--allow-lossy-cast only applies to a cast: add --dtype TYPE, or drop --allow-lossy-cast",
    ),
    "model type the files contradict": (
        ["meta/llama3", "--to", "hf", "--model-type", "mistral"],
        "params.json: describes a llama3 model, not mistral; drop --model-type, or pass --force-model-type",
    ),
}


def run(args: list[str], dst: Path) -> subprocess.CompletedProcess[str]:
    src, *rest = args
    cmd = [sys.executable, "-m", "ckptkit", "convert", str(FIXTURES / src), str(dst), *rest]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("args", "message"), CASES.values(), ids=CASES.keys())
def test_contradictory_options_are_refused_in_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    proc = run(args, tmp_path / "out")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_force_model_type_overrides_what_the_files_say(tmp_path: Path) -> None:
    convert(
        FIXTURES / "hf/llama3",
        tmp_path / "out",
        ConvertOptions("internal", model_type="llama3_1", force_model_type=True),
    )
    assert (tmp_path / "out" / "ckptkit.json").read_text().count('"model_type": "llama3_1"') >= 1


def test_a_model_type_that_agrees_with_the_files_is_accepted(tmp_path: Path) -> None:
    convert(FIXTURES / "meta/llama3", tmp_path / "out", ConvertOptions("hf", model_type="llama3"))
