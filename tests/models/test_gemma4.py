"""Gemma 4: detection from the causal-LM (``gemma4_text``) and the multimodal release layouts,
every tensor random, the vision tower carried and listed, bitwise round trips HF <-> hf-bin <->
internal <-> DCP, and the HF output loaded by transformers with the source's logits.

Fixtures (``fixtures/make_release_fixtures.py``): ``hf/gemma4-text`` has per-layer embeddings
and KV-shared layers with a double-wide MLP; ``hf/gemma4`` has experts beside the MLP and a
full layer whose values are its keys; both have sliding and full layers of different head sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_helpers import (
    FIXTURES,
    assert_every_tensor_random,
    causal_lm_logits,
    convert,
    convert_chain,
    files,
    read_tensors,
)

from ckptkit.checkpoint import open_checkpoint
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path

NAMES = ["gemma4-text", "gemma4"]
IDS = [5, 17, 200, 3, 99, 311, 42, 7, 250, 1, 64, 128]  # past the sliding window of 5


def stored(name: str) -> dict[str, str]:
    return json.loads((FIXTURES / "hf" / name / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("name", NAMES)
def test_detected_with_each_layer_kind_and_the_towers_listed(name: str) -> None:
    src, multimodal = FIXTURES / "hf" / name, name == "gemma4"
    with open_checkpoint(src) as ckpt:
        assert ckpt.family.name == "gemma4"
        f, shapes = ckpt.config.extra, {k: v.shape for k, v in ckpt.tensors.items()}
        assert ckpt.family.sliding_windows(ckpt.config) == ([5, 5, None] if multimodal else [5, None, 5, None])
        full = 2 if multimodal else 1
        assert shapes[f"layers.{full}.attn.q_norm.scale"] == (16,) and shapes["layers.0.attn.q_norm.scale"] == (12,)
        if multimodal:  # the full layer's values are its keys; experts beside the MLP
            assert "layers.2.attn.v_proj.weight" not in shapes and "layers.0.attn.v_proj.weight" in shapes
            assert shapes["layers.2.attn.k_proj.weight"] == (16, 40)  # 1 KV head of 16 (2 of 12 in layer 0)
            assert shapes["layers.0.attn.k_proj.weight"] == (24, 40)
            assert shapes["layers.1.moe.experts.gate_up_proj"] == (4, 48, 40) and f.wrapper is not None
        else:  # layers 2 and 3 reuse 0 and 1's keys and values, with an MLP twice as wide
            assert "layers.2.attn.k_proj.weight" not in shapes and "layers.1.attn.v_proj.weight" in shapes
            assert shapes["layers.3.mlp.w1.weight"] == (112, 40) and shapes["layers.1.mlp.w1.weight"] == (56, 40)
            assert shapes["ple.tok_embeddings.weight"] == (384, 24) and f.wrapper is None
    towers = [k for k in stored(name) if k.startswith(("model.vision_tower.", "model.embed_vision."))]
    assert (len(towers) >= 10) == multimodal
    listed = [t["name"] for t in inspect_path(src)["tensors"]]
    assert sorted(listed) == sorted(stored(name))


@pytest.mark.parametrize("name", NAMES)
def test_fixture_has_every_parameter_random(name: str) -> None:
    with open_checkpoint(FIXTURES / "hf" / name) as ckpt:
        assert_every_tensor_random(ckpt)


@pytest.mark.parametrize("name", NAMES)
def test_hf_to_bin_to_internal_to_dcp_to_hf_is_byte_identical(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    out = convert_chain(src, tmp_path, "hf-bin", "internal", "dcp --shards 2", "hf")
    assert files(out) == files(src)


@pytest.mark.parametrize("name", NAMES)
def test_hf_written_from_dcp_gives_transformers_the_source_s_logits(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    convert(src, tmp_path / "dcp", "dcp")
    (tmp_path / "dcp" / "ckptkit-origin.json").unlink()  # no record of the HF folder: config.json written afresh
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")
    written, saved = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", src))
    saved.pop("transformers_version")
    assert written == saved
    want, got = read_tensors(src), read_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    want_logits, got_logits = causal_lm_logits(src, IDS), causal_lm_logits(tmp_path / "hf", IDS)
    assert want_logits.abs().max() > 0 and (got_logits - want_logits).abs().max().item() == 0.0


def test_a_layer_type_neither_sliding_nor_full_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in (FIXTURES / "hf" / "gemma4-text").iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["layer_types"][1] = "linear_attention"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CkptkitError, match="layer_types must list sliding_attention or full_attention"):
        open_checkpoint(src)


def test_the_kv_shared_layers_keys_and_values_of_google_s_releases_are_carried(tmp_path: Path) -> None:
    """Google's small releases store k/v projections and key norms for the KV-shared layers,
    which transformers ignores on load: read, carried bitwise through every format, unused."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for p in (FIXTURES / "hf" / "gemma4-text").iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    gen = torch.Generator().manual_seed(4)
    extra = {}
    for i, d in ((2, 12), (3, 16)):  # layer 2 sliding (head_dim 12), layer 3 full (16); one KV head
        a = f"model.layers.{i}.self_attn."
        extra |= {a + "k_proj.weight": (d, 40), a + "v_proj.weight": (d, 40), a + "k_norm.weight": (d,)}
    added = {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in extra.items()}
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    save_file({**load_file(src / last), **added}, src / last, metadata={"format": "pt"})
    index["weight_map"] |= dict.fromkeys(added, last)
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    with open_checkpoint(src) as ckpt:
        assert ckpt.config.extra.shared_kv_stored and ckpt.tensors["layers.3.attn.v_proj.weight"].shape == (16, 40)
    assert set(added) <= {t["name"] for t in inspect_path(src)["tensors"]}
    out = convert_chain(src, tmp_path, "internal", "dcp", "hf")
    assert read_tensors(out).keys() == read_tensors(src).keys()
    assert all(torch.equal(read_tensors(out)[k], v) for k, v in added.items())
    original = causal_lm_logits(FIXTURES / "hf" / "gemma4-text", IDS)
    assert (causal_lm_logits(out, IDS) - original).abs().max().item() == 0.0
