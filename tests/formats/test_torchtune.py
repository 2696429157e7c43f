"""torchtune's Meta output (FullModelMetaCheckpointer) reads as ``meta``.

torchtune saves a Meta-named state dict with one ``torch.save`` into
``model-00001-of-00001.bin`` (``meta_model_N.pt`` before 0.3), drops ``rope.freqs`` (its
model has no such parameter), re-adds Llama 3.2's tied ``output.weight`` as the embedding
tensor itself (shared storage), and copies ``params.json`` and the tokenizer beside it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path

from conftest import FIXTURES, assert_same_layout


def torchtune_output(family: str, out: Path, name: str) -> Path:
    """What torchtune's Meta checkpointer writes for the weights of Meta fixture ``family``."""
    src = FIXTURES / "meta" / family
    meta = torch.load(src / "consolidated.00.pth", weights_only=True)
    state = {k: v.clone() for k, v in meta.items() if k != "rope.freqs"}
    if family == "llama3_2":
        state["output.weight"] = state["tok_embeddings.weight"]  # the same tensor, as torchtune does
    out.mkdir(parents=True)
    torch.save(state, out / name)
    for p in src.iterdir():
        if p.suffix not in (".pth", ".pt", ".bin", ".safetensors"):
            shutil.copy(p, out / p.name)
    return out


@pytest.mark.parametrize(
    ("family", "name"),
    [("llama3", "model-00001-of-00001.bin"), ("llama2", "meta_model_0.pt"), ("llama3_2", "model-00001-of-00001.bin")],
)
def test_torchtune_meta_output_converts_like_consolidated(family: str, name: str, tmp_path: Path) -> None:
    tt = torchtune_output(family, tmp_path / "epoch_0", name)
    info = inspect_path(tt)
    assert (info["format"], info["model_type"], info["files"]) == ("meta", family, [name])
    convert(tt, tmp_path / "hf_tt", ConvertOptions("hf"))
    convert(FIXTURES / "meta" / family, tmp_path / "hf_ref", ConvertOptions("hf"))
    assert_same_layout(tmp_path / "hf_ref", tmp_path / "hf_tt")
    assert (tmp_path / "hf_tt" / "config.json").read_bytes() == (tmp_path / "hf_ref" / "config.json").read_bytes()
    # back to meta restores torchtune's own file
    convert(tmp_path / "hf_tt", tmp_path / "back", ConvertOptions("meta"))
    assert_same_layout(tt, tmp_path / "back")


def test_several_torchtune_files_are_one_line_error(tmp_path: Path) -> None:
    tt = torchtune_output("llama3", tmp_path / "out", "meta_model_0.pt")
    shutil.copy(tt / "meta_model_0.pt", tt / "meta_model_1.pt")
    with pytest.raises(CkptkitError, match="holds 2 torchtune checkpoints"):
        convert(tt, tmp_path / "hf", ConvertOptions("hf"))
