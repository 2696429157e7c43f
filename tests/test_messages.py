"""What a user gets wrong is answered in one line that names the option or file, says
what is wrong and what to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.formats import format_names

from conftest import FIXTURES


def ckptkit(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


CHOICES = {
    "--to huggingface": (
        ["--to", "huggingface"],
        f"error: --to huggingface: not one of {', '.join(format_names())}; did you mean 'hf'?",
    ),
    "--dtype int8": (["--to", "hf", "--dtype", "int8"], "error: --dtype int8: not one of bfloat16, float16, float32"),
    "--dtype=fp16": (["--to", "hf", "--dtype=fp16"], "did you mean 'float16'?"),
    "--model-type lama2": (["--to", "hf", "--model-type", "lama2"], "did you mean 'llama2'?"),
}


@pytest.mark.parametrize(("args", "expected"), CHOICES.values(), ids=CHOICES.keys())
def test_an_unknown_choice_lists_the_valid_ones_and_the_nearest(args: list[str], expected: str, tmp_path: Path) -> None:
    line = one_line(ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "o", *args), 2)
    assert expected in line


def test_a_shard_size_without_a_known_unit_explains_the_units(tmp_path: Path) -> None:
    line = one_line(
        ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "o", "--to", "hf", "--max-shard-size", "5gigs"), 1
    )
    assert "--max-shard-size 5gigs: not a size; write a number and one of KB, MB, GB, TB" in line


@pytest.mark.parametrize(("to", "name"), [("meta", "sub"), ("gguf", "model.gguf")])
def test_a_destination_under_a_regular_file_names_that_file(to: str, name: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    line = one_line(ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "afile" / name, "--to", to), 1)
    assert f"{tmp_path / 'afile'} is a file, not a folder; choose a DST outside it" in line
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("to", ["hf", "meta"])
def test_a_failed_conversion_leaves_no_folder_it_created(to: str, tmp_path: Path) -> None:
    """The folders above DST that a conversion creates go again when it fails while
    writing (here: a value that overflows float16, found when its tensor is cast)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "hf/llama2", src)
    last = sorted(src.glob("model-*.safetensors"))[-1]
    with safe_open(last, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(last)
    tensors[sorted(tensors)[-1]].view(-1)[0] = 1e30
    save_file(tensors, last, metadata=metadata)
    line = one_line(ckptkit("convert", src, tmp_path / "new" / "deeper" / "out", "--to", to, "--dtype", "float16"), 1)
    assert "overflow to inf" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(("fixture", "config"), [("meta/llama2", "params.json"), ("hf/llama2", "config.json")])
def test_weights_without_their_config_file_name_the_missing_file(fixture: str, config: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, src)
    (src / config).unlink()
    line = one_line(ckptkit("inspect", src), 1)
    assert f"but no {config}; copy the {config} that came with them into the folder" in line


def test_an_unknown_config_key_names_the_yaml_file(tmp_path: Path) -> None:
    ckptkit("cp", "tiny_lora", tmp_path / "my.yaml")
    with (tmp_path / "my.yaml").open("a") as f:
        f.write("\nbogus_key: 1\n")
    line = one_line(ckptkit("run", "lora_finetune", "--config", tmp_path / "my.yaml"), 1)
    assert line.startswith(f"error: {tmp_path / 'my.yaml'}: config: unknown key bogus_key")
