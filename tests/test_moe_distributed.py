"""FSDP2 on 2 gloo processes trains the mixture-of-experts families (Qwen3-MoE, Mixtral) with
the single-device losses: the router's load-balancing loss is computed over every rank's
tokens, and every expert gets a gradient on every rank.

Tolerance, from the run's dtype: each step's loss is a float32 sum added in another order
(two ranks, each its half) from a model whose matmuls see other batch shapes, so per-step
losses agree to a few units in the last place of that dtype: 16 float32 ulps where
everything is float32; one bfloat16 rounding step (its eps) in bf16. float32 weights and
adapters as in test_distributed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed import ADAPTER_ATOL, WEIGHT_ATOL, assert_same_names_partition_dtypes, losses, run_single, torchrun

from ckptkit.convert import convert
from ckptkit.train.transformer import SparseMoE

from conftest import FIXTURES, raw_layout

RTOL = {"fp32": 16 * torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}
AUX = "router_aux_loss_coef=0.1"  # a hundred times config.json's, so that the aux loss counts


def assert_close(a: list[float], b: list[float], dtype: str) -> None:
    assert len(a) == len(b) == 4
    assert all(abs(x - y) <= RTOL[dtype] * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


@pytest.mark.slow
def test_full_fine_tuning_of_qwen3_moe_on_two_processes_matches_one_device(tmp_path: Path) -> None:
    base = tmp_path / "base"
    convert(FIXTURES / "hf" / "qwen3_moe-stacked", base, "hf", dtype="float32")
    common = ["epochs=1", "max_steps_per_epoch=4", "quiet=true", AUX, f"checkpointer.checkpoint_dir={base}"]
    run_single("full_finetune", "tiny_full", *common, "batch_size=8", f"checkpointer.output_dir={tmp_path / 'one'}")
    target = ["-m", "ckptkit.train.recipes.full_finetune_distributed"]
    torchrun(target, "--config", "tiny_full_distributed", *common, f"checkpointer.output_dir={tmp_path / 'two'}")
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "two"), "fp32")
    worst = assert_same_names_partition_dtypes(tmp_path / "one" / "epoch_0", tmp_path / "two" / "epoch_0")
    assert max(worst.values()) < WEIGHT_ATOL, worst
    names = [k for f in raw_layout(tmp_path / "two" / "epoch_0").values() for k, _ in f]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # stacked in, stacked out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_on_mixtral_on_two_processes_matches_one_device(dtype: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    common = ["epochs=1", "max_steps_per_epoch=4", "quiet=true", AUX, f"dtype={dtype}", "lora.targets=[q,k,v,o,router]",
              f"checkpointer.checkpoint_dir={FIXTURES / 'hf' / 'mixtral'}"]  # fmt: skip
    run_single("lora_finetune", "tiny_lora", *common, "batch_size=8", f"checkpointer.output_dir={tmp_path / 'one'}")
    target = ["-m", "ckptkit.train.recipes.lora_finetune_distributed"]
    torchrun(target, "--config", "tiny_lora_distributed", *common, f"checkpointer.output_dir={tmp_path / 'two'}")
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "two"), dtype)
    a, b = (load_file(tmp_path / r / "epoch_0" / "adapter" / "adapter_model.safetensors") for r in ("one", "two"))
    assert a.keys() == b.keys() and any(".mlp.gate.lora_A" in k for k in a)
    if dtype == "fp32":  # in bf16 an AdamW step on a near-zero gradient may go either way
        assert max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_ATOL


def test_every_expert_gets_a_gradient_also_without_tokens() -> None:
    # FSDP2 reduce-scatters a layer's gradients together: an expert no token of one rank
    # reaches must still have one (zero) there.
    from train_helpers import native_model

    model = native_model("mixtral").train()
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    ids = torch.tensor([[5, 6]])
    model(ids).sum().backward()
    routed = {int(e) for e in torch.topk(moe.router_logits, moe.top_k, dim=-1).indices.flatten()}
    idle = [e for e in range(len(moe.experts)) if e not in routed]
    assert idle  # 2 tokens x top-2 of 4 experts: here one expert is left out
    for e in idle:
        for p in moe.experts[e].parameters():
            assert p.grad is not None and not p.grad.any()
