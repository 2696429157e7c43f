"""Conversions that copy tensors file to file write the same bytes as conversions that read
every tensor into memory; row moves (rope permutation, fused split/join, rank merge/split)
are copied too, only casts and generated tensors are computed; and a conversion that needs
no tensor operation does not import torch."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import COMPUTED, ConvertOptions, Options, Result, convert, write_checkpoint
from ckptkit.errors import CkptkitError
from ckptkit.io import COPY_METHODS
from ckptkit.io.transfer import DIRECT, GATHER, METHODS, STREAM

from conftest import FIXTURES, assert_same_files

CASES = [
    ("hf/llama2", "meta", {}),  # safetensors -> .pth, CRC over the source mapping; q/k rows permuted
    ("meta/llama2", "hf", {}),  # .pth -> safetensors
    ("hf-bin/llama2", "meta", {}),  # .bin -> .pth, the source records' CRCs carried
    ("meta/llama3-2rank", "hf-bin", {}),  # rank merges on dim 0 and 1
    ("hf/llama3", "meta", {"shards": 2}),  # rank splits
    ("meta/llama2-2rank", "meta", {"shards": 4}),  # merged and split again
    ("hf/phi3", "internal", {}),  # fused qkv/gate_up split into row ranges
    ("hf/qwen2", "hf-bin", {"max_shard_size": "40KB"}),
    ("hf/llama3_2", "hf", {"dtype": "float32"}),  # cast: computed
]


@pytest.mark.parametrize(("src", "to", "kw"), CASES, ids=[f"{s}>{t}{'+' if k else ''}" for s, t, k in CASES])
def test_fast_path_writes_the_same_bytes_as_the_slow_path(src: str, to: str, kw: dict, tmp_path: Path) -> None:
    slow = convert(FIXTURES / src, tmp_path / "slow", ConvertOptions(to, copy_method=None, **kw))
    fast = convert(FIXTURES / src, tmp_path / "fast", ConvertOptions(to, **kw))
    assert_same_files(tmp_path / "slow", tmp_path / "fast")
    assert set(slow.bytes_by_method) == {COMPUTED}
    total = sum(slow.bytes_by_method.values())
    assert sum(fast.bytes_by_method.values()) == total
    computed = fast.bytes_by_method.get(COMPUTED, 0)
    if "dtype" in kw:
        assert computed == total
    else:  # at most Meta's generated rope.freqs
        assert computed <= 64, fast.bytes_by_method


def _forced(src: Path, dst: Path, to: str, method: str) -> Result:
    """A conversion with ``method`` forced: a user's choice through :func:`convert`, a
    fallback (gather, copy_file_range...) through the internal :func:`write_checkpoint`."""
    if method in COPY_METHODS:
        return convert(src, dst, ConvertOptions(to, copy_method=method))
    with open_checkpoint(src) as ckpt:
        return write_checkpoint(ckpt, dst, Options(to), copy_method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("src", "to"), [("hf/llama2", "meta"), ("meta/llama2", "hf-bin")])
def test_each_forced_copy_method_gives_the_same_output(src: str, to: str, method: str, tmp_path: Path) -> None:
    convert(FIXTURES / src, tmp_path / "slow", ConvertOptions(to, copy_method=None))
    result = _forced(FIXTURES / src, tmp_path / "fast", to, method)
    # direct writes whole pages past the page cache; these tensors have too few, so they stream
    allowed = {method, STREAM} if method == DIRECT else {method}
    assert set(result.bytes_by_method) <= allowed | {COMPUTED}
    assert sum(n for m, n in result.bytes_by_method.items() if m in allowed) > 0
    assert_same_files(tmp_path / "slow", tmp_path / "fast")


def _copied(by_method: dict[str, int]) -> int:
    """Bytes streamed, through the page cache or direct (``auto`` picks per window)."""
    assert set(by_method) <= {STREAM, DIRECT, COMPUTED}, by_method
    return by_method.get(STREAM, 0) + by_method.get(DIRECT, 0)


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_permuted_rows_and_whole_tensors_are_streamed_file_to_file(tmp_path: Path) -> None:
    """hf -> meta of Llama 2 and back: q_proj and k_proj rows are permuted within each
    window the stream reads, every other tensor is copied as it is, and only Meta's
    rope.freqs is computed."""
    src = FIXTURES / "hf" / "llama2"
    permuted = total = 0
    for shard in src.glob("*.safetensors"):
        for name, entry in _safetensors_header(shard).items():
            if name == "__metadata__":
                continue
            nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
            total += nbytes
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                permuted += nbytes
    result = convert(src, tmp_path / "meta", ConvertOptions("meta"))
    generated = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)["rope.freqs"].nbytes
    assert permuted > 0
    assert _copied(result.bytes_by_method) == total and result.bytes_by_method[COMPUTED] == generated
    back = convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))
    assert _copied(back.bytes_by_method) == total and COMPUTED not in back.bytes_by_method
    for shard in src.glob("*.safetensors"):
        assert (tmp_path / "hf" / shard.name).read_bytes() == shard.read_bytes(), shard.name


TORCH_FREE = [
    ("hf/llama2", "internal"),
    ("hf/llama3", "hf"),
    ("internal", "hf"),
    ("meta/llama2", "hf"),
    ("meta/llama3-2rank", "hf"),
    ("hf/llama3", "meta"),  # the .pth skeleton is written without torch (formats/torch_zip.py)
    ("hf/qwen2", "hf-bin"),
]


@pytest.mark.parametrize(("src", "to"), TORCH_FREE)
def test_a_conversion_without_tensor_operations_never_imports_torch(src: str, to: str, tmp_path: Path) -> None:
    if src == "internal":
        convert(FIXTURES / "hf" / "llama2", tmp_path / "internal", ConvertOptions("internal"))
        source = tmp_path / "internal"
    else:
        source = FIXTURES / src
    code = (
        "import sys; from ckptkit.cli import app; "
        f"sys.argv = ['ckptkit', 'convert', {str(source)!r}, {str(tmp_path / 'out')!r}, '--to', {to!r}, '--quiet']\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert any(p.suffix in (".safetensors", ".pth", ".bin") for p in (tmp_path / "out").iterdir())


def test_cli_copy_method_is_reported_and_off_goes_through_memory(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    runner = CliRunner()
    src = str(FIXTURES / "hf" / "llama3")
    fast = runner.invoke(app, ["convert", src, str(tmp_path / "a"), "--to", "hf", "--copy-method", "stream"])
    slow = runner.invoke(app, ["convert", src, str(tmp_path / "b"), "--to", "hf", "--copy-method", "off"])
    assert fast.exit_code == 0 and "100% of tensor bytes copied file to file" in fast.output
    assert slow.exit_code == 0 and "0% of tensor bytes copied file to file" in slow.output
    assert_same_files(tmp_path / "a", tmp_path / "b")
    for bad in ("splice", "sendfile", "gather"):  # fallbacks are not a user's choice
        refused = runner.invoke(app, ["convert", src, str(tmp_path / "c"), "--to", "hf", "--copy-method", bad])
        assert refused.exit_code == 2 and not (tmp_path / "c").exists(), bad


def test_the_copy_method_choices_are_four(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    args = ["convert", str(FIXTURES / "hf" / "llama3"), str(tmp_path / "c"), "--to", "hf", "--copy-method", "x"]
    refused = CliRunner().invoke(app, args, env={"COLUMNS": "2000"})
    assert refused.exit_code == 2
    assert "--copy-method x: not one of auto, direct, stream, off" in refused.output


def test_convert_refuses_a_fallback_as_copy_method(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match="--copy-method must be one of auto, direct, stream, not 'sendfile'"):
        convert(FIXTURES / "hf" / "llama3", tmp_path / "out", ConvertOptions("hf", copy_method="sendfile"))
    assert not (tmp_path / "out").exists()


def test_verbose_reports_the_fallbacks_auto_chose(tmp_path: Path, monkeypatch) -> None:
    """Spans that streaming would read too much of (here: all, as if every tensor were a
    column slice of a large one) are gathered by auto, and --verbose says so (the log of
    ckptkit.io and the bytes of each method)."""
    from typer.testing import CliRunner

    from ckptkit.cli import app
    from ckptkit.io import stream

    monkeypatch.setattr(stream, "sparse", lambda spans: len(spans) > 1)
    src = str(FIXTURES / "meta" / "llama3-2rank")
    args = ["convert", src, str(tmp_path / "a"), "--to", "hf", "--verbose"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "ckptkit.io.direct: output of" in result.output  # auto's choice between direct and buffered
    line = next(x for x in result.output.splitlines() if x.startswith("tensor bytes by method:"))
    assert f"{GATHER} " in line and f"{STREAM} " in line, line
    quiet = CliRunner().invoke(app, ["convert", src, str(tmp_path / "b"), "--to", "hf"])
    assert quiet.exit_code == 0 and "ckptkit.io" not in quiet.output and "by method" not in quiet.output
