"""Conversions against the reference: transformers for HF semantics, the Meta fixtures
(written independently by fixtures/make_fixtures.py) for Meta's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES, assert_same_layout

META_FIXTURES = [
    "llama2", "llama3", "llama3_1", "llama3_2", "mistral", "mixtral", "llama2-2rank", "llama3-2rank", "mixtral-2rank"
]  # fmt: skip


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", META_FIXTURES)
def test_meta_to_hf_matches_transformers(name: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    convert(FIXTURES / "meta" / name, out, ConvertOptions("hf"))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = _logits(FIXTURES / "hf" / name.split("-")[0], ids)
    converted = _logits(out, ids)
    assert (converted - reference).abs().max().item() == 0.0


@pytest.mark.parametrize("family", ["llama2", "llama3", "llama3_1", "llama3_2", "mistral"])
def test_hf_to_meta_equals_meta_fixture(family: str, tmp_path: Path) -> None:
    out = tmp_path / "meta"
    convert(FIXTURES / "hf" / family, out, ConvertOptions("meta"))
    assert_same_layout(FIXTURES / "meta" / family, out)
    # params.json describes the same model as Meta's own
    with open_checkpoint(out) as a, open_checkpoint(FIXTURES / "meta" / family) as b:
        ffn_spelling_differs = _meta_ffn(a.config) != _meta_ffn(b.config)
        assert a.config == b.config or (ffn_spelling_differs and _same_but_ffn(a.config, b.config))


def _meta_ffn(cfg) -> tuple:
    return cfg.extra.multiple_of, cfg.extra.ffn_dim_multiplier


def _same_but_ffn(a, b) -> bool:
    def plain(c):
        return c.replace_fields(multiple_of=None, ffn_dim_multiplier=None)

    return plain(a) == plain(b)


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_shards_2_equals_two_rank_fixture(family: str, tmp_path: Path) -> None:
    out = tmp_path / "meta2"
    convert(FIXTURES / "hf" / family, out, ConvertOptions("meta", shards=2))
    assert_same_layout(FIXTURES / "meta" / f"{family}-2rank", out)


@pytest.mark.parametrize("fixture", ["mixtral", "mixtral-2rank"])
def test_hf_mixtral_to_meta_holds_the_meta_fixture_tensors(fixture: str, tmp_path: Path) -> None:
    """Mistral's layout, 1 and 2 ranks (experts and router whole on each): every rank's tensors
    as the fixture has them, and the same params.json (the order of keys in a rank is ckptkit's)."""
    want = FIXTURES / "meta" / fixture
    ranks = sorted(p.name for p in want.glob("consolidated.*.pth"))
    convert(FIXTURES / "hf" / "mixtral", tmp_path / "meta", ConvertOptions("meta", shards=len(ranks)))
    assert sorted(p.name for p in (tmp_path / "meta").glob("consolidated.*")) == ranks
    for rank in ranks:
        a, b = (torch.load(d / rank, weights_only=True) for d in (tmp_path / "meta", want))
        assert sorted(a) == sorted(b)
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
    assert json.loads((tmp_path / "meta" / "params.json").read_text()) == json.loads((want / "params.json").read_text())


def test_llama2_meta_carries_rope_freqs_like_meta(tmp_path: Path) -> None:
    convert(FIXTURES / "hf" / "llama2", tmp_path / "m", ConvertOptions("meta"))
    sd = torch.load(tmp_path / "m" / "consolidated.00.pth", weights_only=True)
    head_dim = 16
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert sd["rope.freqs"].dtype == torch.bfloat16
    assert torch.equal(sd["rope.freqs"], expected.to(torch.bfloat16))


def test_hf_written_config_has_both_rope_spellings(tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / "llama3_1", tmp_path / "hf", ConvertOptions("hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and cfg["rope_parameters"]["factor"] == 8.0
    assert cfg["rope_scaling"]["factor"] == 8.0 and cfg["rope_theta"] == 500000.0
    assert cfg["dtype"] == "bfloat16"


def test_meta_2rank_to_hf_to_meta_restores_ranks(tmp_path: Path) -> None:
    src = FIXTURES / "meta" / "llama3-2rank"
    convert(src, tmp_path / "hf", ConvertOptions("hf"))
    convert(tmp_path / "hf", tmp_path / "back", ConvertOptions("meta"))
    assert sorted(p.name for p in (tmp_path / "back").glob("consolidated.*")) == [
        "consolidated.00.pth",
        "consolidated.01.pth",
    ]
    assert_same_layout(src, tmp_path / "back")
    assert (tmp_path / "back" / "params.json").read_bytes() == (src / "params.json").read_bytes()
