"""LoRA on gpt-oss's router: a linear in ckptkit's model, a bare parameter in transformers'
(``GptOssTopKRouter``) that PEFT adapts through ``target_parameters`` (``mlp.router.weight``).
PEFT loads the adapter with the native model's logits, and ckptkit reads PEFT's back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quantized_base import MXFP4, losses, stored, train

from ckptkit.errors import CkptkitError
from ckptkit.train.lora import apply_lora, base_state_dict, lora_modules, merge_lora, unmerge_lora
from ckptkit.train.peft_io import load_adapter, save_adapter

from train_helpers import hf_model, native_model


def test_router_lora_loads_in_peft_as_target_parameters_with_equal_logits(tmp_path: Path) -> None:
    from peft import PeftModel

    model = apply_lora(native_model("gpt_oss"), ["q", "router"], rank=4, alpha=8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_b.normal_(std=0.1, generator=generator)
    save_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["target_parameters"], config["target_modules"]) == (["mlp.router.weight"], ["q_proj"])
    peft = PeftModel.from_pretrained(hf_model("gpt_oss"), tmp_path / "adapter").eval()
    back = load_adapter(native_model("gpt_oss"), tmp_path / "adapter").eval()
    ids = torch.randint(3, 300, (2, 10), generator=generator)
    with torch.no_grad():
        theirs, ours = peft(ids).logits, model.eval()(ids)
        assert (theirs - hf_model("gpt_oss")(ids).logits).abs().max() > 0.1  # the adapter acts
        assert (theirs - ours).abs().max().item() <= 1e-6  # measured 3.6e-7
        assert torch.equal(back(ids), ours)


def test_router_lora_trains_on_the_mxfp4_release(tmp_path: Path) -> None:
    """q and router adapters train on the MXFP4 base; the merged model changes those weights
    only, the experts keep their MXFP4 bytes."""
    run = train(MXFP4, tmp_path / "run", "lora.targets=[q,router]", "max_steps_per_epoch=2")
    assert len(set(losses(run))) == 2
    source, merged = stored(MXFP4), stored(run)
    changed = sorted(n for n in source if not torch.equal(merged[n].view(torch.uint8), source[n].view(torch.uint8)))
    assert changed == sorted(n for n in source if n.endswith(("q_proj.weight", "router.weight")))


def test_peft_made_expert_adapter_loads_and_merges_as_peft() -> None:
    """PEFT's own adapter on the stacked experts (both nested on ``mlp.experts``, one A [E*r, in]
    and one B [out, r*E] each) and the router: ckptkit's logits equal, its merge equals
    ``merge_and_unload`` bit for bit, and un-merging gives the base back."""
    import tempfile

    from peft import LoraConfig, get_peft_model

    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"]
    config = LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj"], target_parameters=params)
    torch.manual_seed(3)
    peft = get_peft_model(hf_model("gpt_oss"), config).eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as folder:
        peft.save_pretrained(folder)
        ours = load_adapter(native_model("gpt_oss"), folder).eval()
    with torch.no_grad():
        theirs = peft(ids).logits
        assert (theirs - hf_model("gpt_oss")(ids).logits).abs().max() > 0.1  # the adapter acts
        assert (ours(ids) - theirs).abs().max().item() <= 1e-6  # measured 3.6e-7
        merged, want = base_state_dict(ours), peft.merge_and_unload().state_dict()
    for i in range(2):
        for t in ("gate_up_proj", "down_proj"):
            assert torch.equal(merged[f"layers.{i}.mlp.experts.{t}"], want[f"model.layers.{i}.mlp.experts.{t}"])
    key = "layers.0.mlp.experts.down_proj"
    start = native_model("gpt_oss").state_dict()[key]
    merge_lora(ours)
    assert torch.equal(ours.state_dict()[key], want[f"model.{key}"])
    unmerge_lora(ours)
    assert (ours.state_dict()[key] - start).abs().max().item() <= 1e-8  # measured 7.5e-9


def test_dropout_on_stacked_experts_is_refused_in_one_line() -> None:
    with pytest.raises(CkptkitError, match="LoRA on stacked experts takes no dropout and no DoRA"):
        apply_lora(native_model("gpt_oss"), ["q", "experts"], rank=2, dropout=0.1)


def test_an_expert_adapter_of_another_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = apply_lora(native_model("gpt_oss"), ["experts"], rank=2)
    save_adapter(model, tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # down_proj's A: [E * r, I]
    tensors[key] = tensors[key][:7]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(CkptkitError, match=r"adapter LoRA A/B shapes \(7, 24\), \(40, 8\) do not fit 4 experts"):
        load_adapter(native_model("gpt_oss"), tmp_path)
