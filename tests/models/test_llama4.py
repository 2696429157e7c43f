"""Llama 4 (``llama4`` / ``llama4_text``): detection from the causal-LM and the multimodal
release layouts, every tensor random, the vision tower carried and listed, bitwise round
trips HF <-> hf-bin <-> internal <-> DCP, and the HF output loaded by transformers with the
source's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_helpers import FIXTURES, assert_every_tensor_random, convert, convert_chain, files

from ckptkit.checkpoint import open_checkpoint
from ckptkit.inspection import inspect_path

NAMES = ["llama4-text", "llama4"]


@pytest.mark.parametrize("name", NAMES)
def test_detected_with_the_vision_tower_listed_by_inspect(name: str) -> None:
    src = FIXTURES / "hf" / name
    with open_checkpoint(src) as ckpt:
        assert ckpt.family.name == "llama4"
        f = ckpt.config.extra
        assert (f.num_experts, f.dense_layers, f.no_rope_layers, f.multimodal) == (
            4,
            [0, 2],
            [1, 0, 1, 0],
            name == "llama4",
        )
        assert_every_tensor_random(ckpt)  # every parameter random
        vision = sorted(ckpt.unused)
    stored = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert vision == sorted(k for k in stored if not k.startswith(("model.", "lm_head", "language_model.")))
    assert len(vision) == (26 if name == "llama4" else 0)
    listed = [t["name"] for t in inspect_path(src)["tensors"]]
    assert set(vision) <= set(listed) and len(listed) == len(stored)


def test_text_model_is_the_multimodal_release_s_language_model() -> None:
    with open_checkpoint(FIXTURES / "hf" / "llama4-text") as a, open_checkpoint(FIXTURES / "hf" / "llama4") as b:
        assert list(a.tensors) == list(b.tensors)
        assert all(torch.equal(a.tensors[k].get(), b.tensors[k].get()) for k in a.tensors)


@pytest.mark.parametrize("name", NAMES)
def test_hf_to_bin_to_internal_to_dcp_to_hf_is_byte_identical(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    out = convert_chain(src, tmp_path, "hf-bin", "internal", "dcp --shards 2", "hf")
    assert files(out) == files(src)


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = AutoConfig.from_pretrained(folder).model_type == "llama4"
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 200, 3, 99, 311, 42, 7, 250, 1, 8, 12]])  # longer than a chunk of 5
    with torch.no_grad():  # text only: its language model (transformers 5.24's wrapper fails without an image)
        return (model.language_model if multimodal else model)(input_ids=ids).logits


@pytest.mark.parametrize("name", NAMES)
def test_hf_written_from_dcp_gives_transformers_the_source_s_logits(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    convert(src, tmp_path / "dcp", "dcp")
    (tmp_path / "dcp" / "ckptkit-origin.json").unlink()  # no record of the HF folder
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")  # config.json written afresh from the DCP's
    written, saved = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", src))
    assert written == {k: v for k, v in saved.items() if k != "transformers_version"}
    want, got = _logits(src), _logits(tmp_path / "hf")
    assert want.abs().max() > 0 and (got - want).abs().max().item() == 0.0
