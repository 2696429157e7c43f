"""hf -> meta for any FFN size Meta's formula can give: the multiple_of / ffn_dim_multiplier solver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.models.meta_ffn import meta_ffn_params, meta_ffn_size

from conftest import assert_same_layout


def reference_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """FeedForward's hidden size as Meta's reference model.py computes it."""
    hidden_dim = 4 * dim
    hidden_dim = int(2 * hidden_dim / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


@settings(max_examples=300, deadline=None)
@given(
    dim=st.integers(1, 16384),
    multiple_of=st.integers(1, 4096),
    multiplier=st.one_of(st.none(), st.floats(0.25, 4.0), st.integers(25, 400).map(lambda k: k / 100)),
)
def test_solver_reproduces_every_ffn_size_meta_can_give(dim: int, multiple_of: int, multiplier: float | None) -> None:
    ffn = reference_ffn(dim, multiple_of, multiplier)
    if ffn < 1:
        return  # Meta's formula gives no FFN at all
    found_multiple, found_multiplier = meta_ffn_params(dim, ffn)
    assert reference_ffn(dim, found_multiple, found_multiplier) == ffn


@settings(max_examples=200, deadline=None)
@given(dim=st.integers(1, 16384), ffn=st.integers(1, 200_000))
def test_any_ffn_size_can_be_expressed(dim: int, ffn: int) -> None:
    found_multiple, found_multiplier = meta_ffn_params(dim, ffn)
    assert reference_ffn(dim, found_multiple, found_multiplier) == ffn


def test_solver_examples() -> None:
    assert meta_ffn_params(120, 336) == (48, None)  # dims where no power-of-two multiple_of works
    assert meta_ffn_params(4096, 11008) == (256, None)  # Llama 2 7B, as Meta ships it
    assert meta_ffn_size(*[96, *meta_ffn_params(96, 280)]) == 280
    with pytest.raises(CkptkitError, match="cannot be expressed"):
        meta_ffn_params(0, 10)


def _save_hf(root: Path, hidden: int, heads: int, intermediate: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(hidden + intermediate)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root)


@pytest.mark.parametrize(
    ("hidden", "heads", "multiple_of", "multiplier"),
    [(120, 4, 48, None), (96, 4, 40, 1.05), (80, 2, 24, 1.3), (72, 3, 7, 0.9)],
)
def test_odd_dims_convert_hf_meta_hf_bitwise(
    hidden: int, heads: int, multiple_of: int, multiplier: float | None, tmp_path: Path
) -> None:
    intermediate = reference_ffn(hidden, multiple_of, multiplier)
    _save_hf(tmp_path / "hf", hidden, heads, intermediate)
    convert(tmp_path / "hf", tmp_path / "meta", ConvertOptions("meta", verify=True))
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert reference_ffn(params["dim"], params["multiple_of"], params.get("ffn_dim_multiplier")) == intermediate
    convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf", verify=True))
    assert_same_layout(tmp_path / "hf", tmp_path / "back")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
