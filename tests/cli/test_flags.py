"""Options that contradict each other, the target format or the files are refused before
anything is read or written, in one line naming the option and what to do: bad usage (exit
2) when the options contradict each other or the target, an input error (exit 1) when they
contradict the files; unknown, missing or malformed options of every command are one line
and exit 2 too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_helpers import ckptkit_in_process, ckptkit_process

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import FlagError
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
    "no model-parallel ranks": (["meta/llama3", "--to", "meta", "--shards", "0"], "--shards must be at least 1"),
    "another format's dtype, any case": (
        ["hf/llama2", "--to", "hf", "--dtype", "q4_0"],
        "--dtype Q4_0 applies only to --to gguf",
    ),
    "a shard size that is not a size": (["hf/llama2", "--to", "hf", "--max-shard-size", "5gigs"], "not a size"),
    "an unknown copy method": (["hf/llama2", "--to", "hf", "--copy-method", "sendfile"], "--copy-method"),
    "lossy cast without a cast": (
        ["hf/llama2", "--to", "hf", "--allow-lossy-cast"],
        "--allow-lossy-cast only applies to a cast: add --dtype TYPE, or drop --allow-lossy-cast",
    ),
}
CONTRADICT_FILES = {
    "model type the files contradict": (
        ["meta/llama3", "--to", "hf", "--model-type", "mistral"],
        "params.json: describes a llama3 model, not mistral; drop --model-type, or pass --force-model-type",
    ),
}


def run(args: list[str], dst: Path) -> subprocess.CompletedProcess[str]:
    """``ckptkit convert FIXTURES/SRC DST REST`` in this process (tests/cli_helpers.py)."""
    src, *rest = args
    return ckptkit_in_process("convert", FIXTURES / src, dst, *rest)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [(*case, 2) for case in CASES.values()] + [(*case, 1) for case in CONTRADICT_FILES.values()],
    ids=[*CASES, *CONTRADICT_FILES],
)
def test_contradictory_options_are_refused_in_one_line(
    args: list[str], message: str, code: int, tmp_path: Path
) -> None:
    proc = run(args, tmp_path / "out")
    assert proc.returncode == code
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


ONE_FILE = {name: fmt.info.file_suffix for name, fmt in REGISTRY.items() if fmt.info.file_suffix}
FOLDERS = [name for name, fmt in REGISTRY.items() if fmt.info.file_suffix is None]


def test_a_folder_format_into_a_gguf_file_name_is_bad_usage(tmp_path: Path) -> None:
    proc = run(["hf/llama2", "--to", "hf"], tmp_path / "model.gguf")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (
        f"error: {tmp_path / 'model.gguf'}: a gguf file name, but --to hf writes a folder; "
        "choose a DST not ending in .gguf, or pass --to gguf"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("one_file", list(ONE_FILE))
@pytest.mark.parametrize("folder", FOLDERS)
def test_no_folder_format_writes_a_folder_named_like_a_one_file_format(
    folder: str, one_file: str, tmp_path: Path
) -> None:
    for dst in (tmp_path / f"model{ONE_FILE[one_file]}", tmp_path / f"model{ONE_FILE[one_file].upper()}"):
        with pytest.raises(FlagError, match=f"--to {folder} writes a folder.*--to {one_file}$"):
            convert(FIXTURES / "hf/llama2", dst, ConvertOptions(folder))
    assert list(tmp_path.iterdir()) == []


# Every command, as a user mistypes it: (arguments, what the one line must say).
USAGE = {
    "no such command": (["frob"], "No such command 'frob'; see `ckptkit -h`"),
    "group option": (["--bogus"], "No such option: --bogus; see `ckptkit -h`"),
    "inspect without PATH": (["inspect"], "Missing argument 'PATH'; see `ckptkit inspect -h`"),
    "inspect unknown option": (["inspect", "x", "--jsn"], "No such option: --jsn"),
    "convert without --to": (["convert", "a", "b"], "Missing option '--to'; see `ckptkit convert -h`"),
    "convert without DST": (["convert", "a", "--to", "hf"], "Missing argument 'DST'"),
    "convert unknown option": (["convert", "a", "b", "--to", "hf", "--bogus"], "No such option: --bogus"),
    "convert bad number": (["convert", "a", "b", "--to", "meta", "--shards", "x"], "Invalid value for '--shards'"),
    "convert --to without value": (["convert", "a", "b", "--to"], "Option '--to' requires an argument"),
    "convert unknown format": (["convert", "a", "b", "--to", "huggingface"], "did you mean 'hf'?"),
    "verify without B": (["verify", "a"], "Missing argument 'B'; see `ckptkit verify -h`"),
    "verify flag with a value": (["verify", "a", "b", "--logits=3"], "Option '--logits' does not take a value"),
    "run without --config": (["run", "full_finetune"], "Missing option '--config'; see `ckptkit run -h`"),
    "run bad process count": (["run", "x", "--config", "y", "--nproc-per-node", "0"], "'--nproc-per-node'"),
    "ls with an argument": (["ls", "extra"], "Got unexpected extra argument(s) (extra); see `ckptkit ls -h`"),
    "cp without DEST": (["cp", "tiny_lora"], "Missing argument 'DEST'; see `ckptkit cp -h`"),
    "generate without --prompt": (["generate", "ckpt"], "Missing option '--prompt'; see `ckptkit generate -h`"),
    "generate negative temperature": (["generate", "c", "--prompt", "p", "--temperature", "-1"], "'--temperature'"),
    "merge without DST": (["merge", "base", "adapter"], "Missing argument 'DST'; see `ckptkit merge -h`"),
    "support unknown option": (["support", "--yaml"], "No such option: --yaml"),
}


# Also run as genuine ``python -m ckptkit`` processes (the others run in this process).
IN_A_PROCESS = ("no such command", "convert without --to", "run bad process count")


@pytest.mark.parametrize(
    ("args", "message"),
    [pytest.param(*case, marks=pytest.mark.slow) if name in IN_A_PROCESS else case for name, case in USAGE.items()],
    ids=USAGE.keys(),
)
def test_bad_usage_of_every_command_is_one_line(args: list[str], message: str, request: pytest.FixtureRequest) -> None:
    proc = ckptkit_in_process(*args)
    if request.node.callspec.id in IN_A_PROCESS:
        real = ckptkit_process(*args)
        assert (real.returncode, real.stdout, real.stderr) == (proc.returncode, proc.stdout, proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
