"""DeepSeek V3 (R1, V3.1, Kimi K2): detection, every tensor random, the MTP layer carried and
listed, bitwise round trips HF <-> hf-bin <-> internal <-> DCP (torchtitan's names), and the
HF output loaded by transformers with the source's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_helpers import (
    FIXTURES,
    assert_every_tensor_random,
    assert_stacked_experts_round_trip,
    causal_lm_logits,
    convert,
    convert_chain,
    files,
    read_tensors,
)

from ckptkit.checkpoint import open_checkpoint
from ckptkit.inspection import inspect_path

NAMES = ["deepseek_v3", "deepseek_v3-qproj"]


@pytest.mark.parametrize("name", NAMES)
def test_detected_with_its_mtp_layer_listed_by_inspect(name: str) -> None:
    src = FIXTURES / "hf" / name
    with open_checkpoint(src) as ckpt:
        assert ckpt.family.name == "deepseek_v3"
        f = ckpt.config.extra
        assert (f.num_experts, f.dense_layers, f.num_nextn_predict_layers, f.mtp_stored) == (4, [0], 1, True)
        assert (f.q_lora_rank is None) == name.endswith("qproj")
        mtp = [k for k in ckpt.tensors if k.startswith("mtp.0.")]
    stored = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    in_mtp = sorted(k for k in stored if k.startswith("model.layers.3."))
    assert sorted("model.layers.3." + k.removeprefix("mtp.0.") for k in mtp) == in_mtp
    assert len(in_mtp) == 6 + len([k for k in stored if k.startswith("model.layers.2.")])  # a MoE layer + 6
    listed = [t["name"] for t in inspect_path(src)["tensors"]]
    assert set(in_mtp) <= set(listed) and len(listed) == len(stored)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_has_every_parameter_random(name: str) -> None:
    with open_checkpoint(FIXTURES / "hf" / name) as ckpt:
        assert_every_tensor_random(ckpt)


@pytest.mark.parametrize("name", NAMES)
def test_hf_to_bin_to_internal_to_hf_is_byte_identical(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    out = convert_chain(src, tmp_path, "hf-bin", "internal", "hf")
    assert files(out) == files(src)


@pytest.mark.parametrize("to", ["dcp", "dcp-titan"])
def test_hf_to_dcp_to_hf_keeps_every_tensor_bitwise(to: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / "deepseek_v3"
    out = convert_chain(src, tmp_path, f"{to} --shards 2", "hf")
    want, got = read_tensors(src), read_tensors(out)
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("name", NAMES)
def test_hf_written_from_dcp_gives_transformers_the_source_s_logits(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    convert(src, tmp_path / "dcp", "dcp-titan")
    (tmp_path / "dcp" / "ckptkit-origin.json").unlink()  # as torchtitan saves it: no record of the HF folder
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")  # config.json written afresh from the DCP's
    written, saved = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", src))
    # every field transformers saved, but its version; plus the top-level rope_theta older readers want
    assert written == {k: v for k, v in saved.items() if k != "transformers_version"} | {"rope_theta": 10000.0}
    want, got = causal_lm_logits(src), causal_lm_logits(tmp_path / "hf")
    assert want.abs().max() > 0 and (got - want).abs().max().item() == 0.0


def test_stacked_experts_load_in_transformers_and_come_back_per_expert(tmp_path: Path) -> None:
    """transformers' own 3-D experts (``mlp.experts.gate_up_proj``); the MTP layer stays as the release has it."""
    src = FIXTURES / "hf" / "deepseek_v3"
    assert_stacked_experts_round_trip(src, tmp_path)


def test_a_checkpoint_without_its_mtp_layer_converts_without_one(tmp_path: Path) -> None:
    """Fine-tunes drop the MTP layer though config.json still counts it: nothing to carry."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    for p in (FIXTURES / "hf" / "deepseek_v3-qproj").iterdir():
        if p.suffix == ".json" and p.name != "model.safetensors.index.json":
            (src / p.name).write_bytes(p.read_bytes())
    kept = {k: v for k, v in read_tensors(FIXTURES / "hf" / "deepseek_v3-qproj").items() if ".layers.3." not in k}
    save_file(kept, src / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(src) as ckpt:
        assert not ckpt.config.extra.mtp_stored and not any(k.startswith("mtp.") for k in ckpt.tensors)
    convert(src, tmp_path / "dcp", "dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", "hf")
    got = read_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(kept) and all(torch.equal(got[k], v) for k, v in kept.items())


# torchtitan's DeepSeek V3 state-dict adapter: the names of a MoE layer (q LoRA) in its model
TITAN_MOE_LAYER = {
    "attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight", "attention.wkv_a.weight",
    "attention.kv_norm.weight", "attention.wkv_b.weight", "attention.wo.weight", "attention_norm.weight",
    "ffn_norm.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3", "moe.router.gate.weight",
    "moe.shared_experts.w1.weight", "moe.shared_experts.w2.weight", "moe.shared_experts.w3.weight",
}  # fmt: skip


@pytest.mark.parametrize(
    ("to", "bias", "output"), [("dcp", "expert_bias", "output"), ("dcp-titan", "expert_bias_E", "lm_head")]
)
def test_dcp_names_are_torchtitan_s(to: str, bias: str, output: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    convert(FIXTURES / "hf" / "deepseek_v3", tmp_path / "dcp", to)
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    layer1 = {k.removeprefix("layers.1.") for k in meta if k.startswith("layers.1.")}
    assert layer1 == TITAN_MOE_LAYER | {f"moe.{bias}"}
    assert {"tok_embeddings.weight", "norm.weight", f"{output}.weight"} <= set(meta)
    assert list(meta["layers.1.moe.experts.w2"].size) == [4, 40, 24]  # [experts, dim, hidden]
