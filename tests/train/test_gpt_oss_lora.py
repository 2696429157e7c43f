"""LoRA on gpt-oss's router: a linear in ckptkit's model, a bare parameter in transformers'
(``GptOssTopKRouter``) that PEFT adapts through ``target_parameters`` (``mlp.router.weight``).
PEFT loads the adapter with the native model's logits, and ckptkit reads PEFT's back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_quantized_base import MXFP4, losses, stored, train

from ckptkit.train.lora import apply_lora, lora_modules
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
