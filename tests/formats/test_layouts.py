"""Layouts users have: one shard with an index (torchtune, many hub repos), and a tied
``.bin`` whose ``lm_head.weight`` shares storage with the embeddings (old save_pretrained)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckptkit.convert import ConvertOptions, convert
from ckptkit.save_like import save_checkpoint_like

from conftest import FIXTURES, assert_same_layout, tree_hashes

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def single_shard_with_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' save_pretrained output renamed and indexed the way torchtune writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("single") / "hf"
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root)
    (root / "model.safetensors").rename(root / SHARD)
    with safe_open(root / SHARD, "pt") as f:
        keys = sorted(f.keys())
    index = {"metadata": {"total_size": os.path.getsize(root / SHARD)}, "weight_map": dict.fromkeys(keys, SHARD)}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


@pytest.mark.parametrize("to", ["hf", "hf-bin", "meta", "internal"])
def test_single_shard_with_index_round_trips_exactly(single_shard_with_index: Path, to: str, tmp_path: Path) -> None:
    src = single_shard_with_index
    convert(src, tmp_path / "mid", ConvertOptions(to, verify=True))
    convert(tmp_path / "mid", tmp_path / "back", ConvertOptions("hf", verify=True))
    assert_same_layout(src, tmp_path / "back")
    back = tree_hashes(tmp_path / "back")
    assert {k: back.get(k) for k in tree_hashes(src)} == tree_hashes(src)


def test_single_shard_with_index_survives_save_like(single_shard_with_index: Path, tmp_path: Path) -> None:
    """What the trainer's checkpointer does: the same layout, index included, holding the
    values given (float32 here) cast to the source's bfloat16 as torch casts them."""
    from safetensors.torch import load_file

    from ckptkit.checkpoint import open_checkpoint

    def changed(t: torch.Tensor) -> torch.Tensor:  # elementwise: commutes with any row permutation
        return t.float() * 3 - 0.25

    with open_checkpoint(single_shard_with_index) as ckpt:
        state = {k: changed(v.get()) for k, v in ckpt.tensors.items()}
    save_checkpoint_like(single_shard_with_index, state, tmp_path / "step")
    assert (tmp_path / "step" / "model.safetensors.index.json").read_bytes() == (
        single_shard_with_index / "model.safetensors.index.json"
    ).read_bytes()
    assert sorted(p.name for p in (tmp_path / "step").glob("*.safetensors")) == [SHARD]
    source, written = (load_file(d / SHARD) for d in (single_shard_with_index, tmp_path / "step"))
    assert list(written) == list(source)
    for k, v in source.items():
        assert written[k].dtype == v.dtype and torch.equal(written[k], changed(v).to(v.dtype)), k


@pytest.mark.parametrize("via", ["hf", "internal"])
def test_tied_bin_alias_is_restored(via: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf-bin" / "qwen2"
    convert(src, tmp_path / "mid", ConvertOptions(via))
    convert(tmp_path / "mid", tmp_path / "back", ConvertOptions("hf-bin", verify=True))
    name = "pytorch_model.bin"
    assert (tmp_path / "back" / name).stat().st_size == (src / name).stat().st_size
    assert_same_layout(src, tmp_path / "back")
    sd = torch.load(tmp_path / "back" / name, weights_only=True)
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    assert head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
