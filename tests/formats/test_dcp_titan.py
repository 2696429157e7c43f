"""torchtitan's 2026 tensor names in DCP (``dcp-titan``): ckptkit writes them so that torch's
own ``dcp.load`` fills the 2026-named tensors bitwise equal to the Meta source's; a folder
torch saved in either spelling is detected as the format of that spelling, and a round trip
through HF or internal keeps it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_dcp import _load

from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats import detect_format
from ckptkit.verify import verify_paths

from conftest import FIXTURES, assert_same_files

META = FIXTURES / "meta" / "llama2"
HF = FIXTURES / "hf" / "llama2"
TITAN = FIXTURES / "dcp-titan" / "llama2"  # torch's dcp.save of META's tensors, 2026 names


def _meta_tensors() -> dict[str, torch.Tensor]:
    sd = torch.load(META / "consolidated.00.pth", weights_only=True)
    return {k: v for k, v in sd.items() if k != "rope.freqs"}


def _titan_name(name: str) -> str:
    """torchtitan's 2026 spelling, written out here from its model's parameter names."""
    renames = {"output.weight": "lm_head.weight"}
    for w in ("wq", "wk", "wv"):
        if f".attention.{w}." in name:
            return name.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
    return renames.get(name, name)


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def _stored_keys(folder: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def _verified(a: Path, b: Path) -> None:
    report = verify_paths(a, b)
    assert report.ok and not report.differences, report.summary()


@pytest.mark.parametrize("shards", [1, 2])
def test_torch_dcp_load_fills_2026_named_tensors_bitwise(tmp_path: Path, shards: int) -> None:
    out = tmp_path / "titan"
    convert(HF, out, ConvertOptions("dcp-titan", shards=shards))
    assert detect_format(out).name == "dcp-titan"
    meta = _meta_tensors()
    titan = {_titan_name(k): v for k, v in meta.items()}
    assert "layers.0.attention.qkv_linear.wq.weight" in titan and "lm_head.weight" in titan
    assert _stored_keys(out) == set(titan)
    # layers.0.attention.qkv_linear.wq.weight is the Meta source's layers.0.attention.wq.weight.
    _assert_bitwise(_load(out, titan), titan)
    _verified(META, out)
    convert(out, tmp_path / "hf", ConvertOptions("hf"))
    assert_same_files(HF, tmp_path / "hf")


def test_a_2026_spelled_folder_torch_saved_is_dcp_titan_and_reads_as_meta(tmp_path: Path) -> None:
    assert detect_format(TITAN).name == "dcp-titan"
    assert detect_format(FIXTURES / "dcp" / "llama2").name == "dcp"
    _verified(TITAN, META)
    _verified(TITAN, FIXTURES / "dcp" / "llama2")


@pytest.mark.parametrize("via", ["hf", "internal", None])
def test_a_round_trip_keeps_the_2026_spelling(tmp_path: Path, via: str | None) -> None:
    first = tmp_path / "first"
    convert(HF, first, ConvertOptions("dcp-titan"))
    src = first
    if via is not None:
        convert(first, tmp_path / "mid", ConvertOptions(via))
        src = tmp_path / "mid"
    convert(src, tmp_path / "back", ConvertOptions("dcp-titan"))
    assert_same_files(first, tmp_path / "back")
    # torch's 2026 save through the same trip: the names torch wrote, the same tensors.
    if via is not None:
        convert(TITAN, tmp_path / "mid2", ConvertOptions(via))
        convert(tmp_path / "mid2", tmp_path / "back2", ConvertOptions("dcp-titan"))
        titan = {_titan_name(k): v for k, v in _meta_tensors().items()}
        assert _stored_keys(tmp_path / "back2") == set(titan)
        _assert_bitwise(_load(tmp_path / "back2", titan), _load(TITAN / "step-10", titan))


def test_either_spelling_converts_to_the_other(tmp_path: Path) -> None:
    convert(TITAN, tmp_path / "meta-names", ConvertOptions("dcp"))
    assert detect_format(tmp_path / "meta-names").name == "dcp"
    _assert_bitwise(_load(tmp_path / "meta-names", _meta_tensors()), _meta_tensors())
    shutil.copytree(FIXTURES / "dcp" / "llama2", tmp_path / "old")
    convert(tmp_path / "old", tmp_path / "new-names", ConvertOptions("dcp-titan"))
    titan = {_titan_name(k): v for k, v in _meta_tensors().items()}
    _assert_bitwise(_load(tmp_path / "new-names", titan), titan)
