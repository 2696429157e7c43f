"""FSDP2 on 2 gloo processes trains the mixture-of-experts families (Qwen3-MoE, Mixtral) with
the single-device losses: the router's load-balancing loss is computed over every rank's
tokens, every expert gets a gradient on every rank, and LoRA on experts keeps the A an
expert's gate and up share one parameter; the 2-process adapters load in PEFT and the merged
model comes out in the input's layout.

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
from test_distributed import (
    ADAPTER_ATOL,
    WEIGHT_ATOL,
    assert_same_names_partition_dtypes,
    bf16_ulps,
    losses,
    run_single,
    torchrun,
)

from ckptkit.convert import ConvertOptions, convert
from ckptkit.train.experts import SparseMoE

from conftest import FIXTURES, raw_layout
from train_helpers import TOL

RTOL = {"fp32": 16 * torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}
AUX = "router_aux_loss_coef=0.1"  # a hundred times config.json's, so that the aux loss counts


def assert_close(a: list[float], b: list[float], dtype: str) -> None:
    assert len(a) == len(b) == 4
    assert all(abs(x - y) <= RTOL[dtype] * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


@pytest.mark.slow
def test_full_fine_tuning_of_qwen3_moe_on_two_processes_matches_one_device(tmp_path: Path) -> None:
    base = tmp_path / "base"
    convert(FIXTURES / "hf" / "qwen3_moe-stacked", base, ConvertOptions("hf", dtype="float32"))
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
@pytest.mark.parametrize(("src", "dtype"), [("meta/mixtral-2rank", "fp32"), ("hf/qwen3_moe-stacked", "bf16")])
def test_lora_on_experts_and_router_on_two_processes_matches_one_device(src: str, dtype: str, tmp_path: Path) -> None:
    """An expert's gate and up share one LoRA A (PEFT's A of the stacked ``gate_up_proj``):
    under FSDP2 it stays one parameter, sharded once, its gradient the sum of both uses."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ckptkit.train.peft_io import load_adapter
    from ckptkit.train.transformer import load_model

    base = FIXTURES / src
    targets = "q,k,v,o,experts,router" + (",gate,up,down" if "qwen3_moe" in src else "")  # and a dense layer
    common = ["epochs=1", "max_steps_per_epoch=4", "quiet=true", AUX, f"dtype={dtype}", f"lora.targets=[{targets}]",
              f"checkpointer.checkpoint_dir={base}"]  # fmt: skip
    run_single("lora_finetune", "tiny_lora", *common, "batch_size=8", f"checkpointer.output_dir={tmp_path / 'one'}")
    target = ["-m", "ckptkit.train.recipes.lora_finetune_distributed"]
    torchrun(target, "--config", "tiny_lora_distributed", *common, f"checkpointer.output_dir={tmp_path / 'two'}")
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "two"), dtype)
    one, two = tmp_path / "one" / "epoch_0", tmp_path / "two" / "epoch_0"
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (one, two))
    assert list(a) == list(b) and any(".mlp.gate.lora_A" in k for k in a)
    assert any(k.endswith("experts.base_layer.lora_A.weight") for k in a)  # gate_up_proj's one A per expert
    if dtype == "fp32":  # in bf16 an AdamW step on a near-zero gradient may go either way
        assert max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_ATOL
    # the 2-process adapter loads in PEFT on transformers' model (the HF copy of a Meta base) with
    # the native model's logits
    hf_base = json.loads((two / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    ids = torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(5))
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32), two / "adapter"
    )
    with torch.no_grad():
        want = peft.eval()(ids).logits
        ours = load_adapter(load_model(str(base), dtype=torch.float32), two / "adapter")(ids)
    assert (ours - want).abs().max().item() <= TOL
    # its merged model in the input's format (files, names, order, dtypes; Meta: 2 ranks), PEFT's
    # merge of its adapter to a bf16 rounding step
    assert_same_names_partition_dtypes(base, two)
    convert(two, tmp_path / "merged_hf", ConvertOptions("hf"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged_hf", dtype=torch.bfloat16).state_dict()
    theirs = peft.merge_and_unload().state_dict()
    assert max(bf16_ulps(v, theirs[k].to(torch.bfloat16)) for k, v in merged.items()) <= 1


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
