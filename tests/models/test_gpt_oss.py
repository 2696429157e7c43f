"""gpt-oss: detection, every tensor random, bitwise round trips HF <-> hf-bin <-> internal <->
DCP, and the HF output loaded by transformers with the source's logits."""

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
from ckptkit.inspection import inspect_path

SRC = FIXTURES / "hf" / "gpt_oss"


def test_detected_with_sinks_biases_and_stacked_experts_listed() -> None:
    with open_checkpoint(SRC) as ckpt:
        assert ckpt.family.name == "gpt_oss"
        f = ckpt.config.extra
        assert (f.num_local_experts, f.num_experts_per_tok, f.sliding_window) == (4, 2, 8)
        assert ckpt.family.sliding_windows(ckpt.config) == [8, None]
        assert ckpt.config.rope_scaling is not None and ckpt.config.rope_scaling["rope_type"] == "yarn"
    stored = json.loads((SRC / "model.safetensors.index.json").read_text())["weight_map"]
    listed = [t["name"] for t in inspect_path(SRC)["tensors"]]
    assert sorted(listed) == sorted(stored) and "model.layers.1.self_attn.sinks" in listed


def test_fixture_has_every_parameter_random() -> None:
    with open_checkpoint(SRC) as ckpt:
        assert_every_tensor_random(ckpt)


def test_hf_to_bin_to_internal_to_hf_is_byte_identical(tmp_path: Path) -> None:
    out = convert_chain(SRC, tmp_path, "hf-bin", "internal", "hf")
    assert files(out) == files(SRC)


@pytest.mark.parametrize("to", ["dcp", "dcp-titan"])
def test_hf_to_dcp_to_hf_keeps_every_tensor_bitwise(to: str, tmp_path: Path) -> None:
    out = convert_chain(SRC, tmp_path, f"{to} --shards 2", "hf")
    want, got = read_tensors(SRC), read_tensors(out)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_hf_written_from_dcp_gives_transformers_the_source_s_logits(tmp_path: Path) -> None:
    convert(SRC, tmp_path / "dcp", "dcp")
    (tmp_path / "dcp" / "ckptkit-origin.json").unlink()  # no record of the HF folder: config.json afresh
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")
    written, saved = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", SRC))
    assert written == {k: v for k, v in saved.items() if k != "transformers_version"}
    ids = [5, 17, 200, 3, 99, 311, 42, 7, 250, 1, 64, 128]  # past the sliding window of 8
    want, got = causal_lm_logits(SRC, ids), causal_lm_logits(tmp_path / "hf", ids)
    assert want.abs().max() > 0 and (got - want).abs().max().item() == 0.0
