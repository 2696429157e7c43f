"""GLM-4.5 (``glm4_moe``): detection, every tensor random, the NextN (MTP) layer carried and
listed, bitwise round trips HF <-> hf-bin <-> internal <-> DCP, and the HF output loaded by
transformers with the source's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_helpers import (
    FIXTURES,
    assert_every_tensor_random,
    assert_stacked_experts_round_trip,
    causal_lm_logits,
    convert,
    convert_chain,
    files,
)

from ckptkit.checkpoint import open_checkpoint
from ckptkit.inspection import inspect_path

SRC = FIXTURES / "hf" / "glm4_moe"


def test_detected_with_its_nextn_layer_listed_by_inspect() -> None:
    with open_checkpoint(SRC) as ckpt:
        assert ckpt.family.name == "glm4_moe"
        f = ckpt.config.extra
        assert (f.num_experts, f.dense_layers, f.num_nextn_predict_layers, f.mtp_stored) == (4, [0], 1, True)
        assert (f.partial_rotary_factor, f.use_qk_norm, ckpt.config.attention_bias) == (0.5, True, True)
        mtp = [k for k in ckpt.tensors if k.startswith("mtp.0.")]
        assert_every_tensor_random(ckpt)  # every parameter and buffer random
    stored = json.loads((SRC / "model.safetensors.index.json").read_text())["weight_map"]
    in_mtp = sorted(k for k in stored if k.startswith("model.layers.3."))
    assert sorted("model.layers.3." + k.removeprefix("mtp.0.") for k in mtp) == in_mtp
    assert len(in_mtp) == 6 + len([k for k in stored if k.startswith("model.layers.2.")])  # a MoE layer + 6
    listed = [t["name"] for t in inspect_path(SRC)["tensors"]]
    assert set(in_mtp) <= set(listed) and len(listed) == len(stored)


def test_hf_to_bin_to_internal_to_hf_is_byte_identical(tmp_path: Path) -> None:
    out = convert_chain(SRC, tmp_path, "hf-bin", "internal", "hf")
    assert files(out) == files(SRC)


@pytest.mark.parametrize("to", ["dcp", "dcp-titan"])
def test_hf_to_dcp_to_hf_keeps_every_tensor_bitwise(to: str, tmp_path: Path) -> None:
    out = convert_chain(SRC, tmp_path, f"{to} --shards 2", "hf")
    assert files(out) == files(SRC)


def test_hf_written_from_dcp_gives_transformers_the_source_s_logits(tmp_path: Path) -> None:
    convert(SRC, tmp_path / "dcp", "dcp")
    (tmp_path / "dcp" / "ckptkit-origin.json").unlink()  # no record of the HF folder
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")  # config.json written afresh from the DCP's
    written, saved = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", SRC))
    # every field transformers saved, but its version; plus the top-level rope_theta older readers want
    assert written == {k: v for k, v in saved.items() if k != "transformers_version"} | {"rope_theta": 1000000.0}
    want, got = causal_lm_logits(SRC), causal_lm_logits(tmp_path / "hf")
    assert want.abs().max() > 0 and (got - want).abs().max().item() == 0.0


def test_stacked_experts_load_in_transformers_and_come_back_per_expert(tmp_path: Path) -> None:
    assert_stacked_experts_round_trip(SRC, tmp_path)


def test_dcp_names_are_torchtitan_s_spelling(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    convert(SRC, tmp_path / "dcp", "dcp")
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    layer1 = {k.removeprefix("layers.1.") for k in meta if k.startswith("layers.1.")}
    attn = {f"attention.w{p}.{w}" for p in "qkv" for w in ("weight", "bias")} | {"attention.wo.weight"}
    moe = {f"moe.experts.w{i}" for i in (1, 2, 3)} | {f"moe.shared_experts.w{i}.weight" for i in (1, 2, 3)}
    norms = {"attention.q_norm.weight", "attention.k_norm.weight", "attention_norm.weight", "ffn_norm.weight"}
    assert layer1 == attn | moe | norms | {"moe.router.gate.weight", "moe.expert_bias"}
    assert list(meta["layers.1.moe.experts.w2"].size) == [4, 40, 24]  # [experts, dim, hidden]
    assert "mtp.0.eh_proj.weight" in meta
