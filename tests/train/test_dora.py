"""DoRA (``use_dora``): ckptkit's adapters and PEFT's load in each other with equal logits,
and merges equal PEFT's ``merge_and_unload`` bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.errors import CkptkitError
from ckptkit.train.lora import apply_lora, lora_modules, lora_state_dict, merge_lora, unmerge_lora
from ckptkit.train.peft_io import load_adapter, prepare_for_peft, save_adapter

from train_helpers import hf_dir, hf_model, native_model, padded_batch

PEFT_TARGETS = {"q": "q_proj", "v": "v_proj", "down": "down_proj"}


def _logits(model: torch.nn.Module, hf: bool = False) -> torch.Tensor:
    ids, mask = padded_batch(384, seed=21)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        if hf:
            return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
        return model(ids, attention_mask=mask)[mask.bool()]


def _trained(model: torch.nn.Module, seed: int) -> None:
    """Adapter values as after training: B non-zero, magnitudes moved off the row norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.05)
            m.lora_magnitude.mul_(1 + 0.1 * torch.randn(m.lora_magnitude.shape, generator=gen))


def test_dora_adapter_loads_in_peft_and_merges_as_peft_does(tmp_path: Path) -> None:
    """The magnitude starts as PEFT's (row norms of W), is saved under PEFT's name, and the
    adapter gives PEFT's logits exactly (float32, measured max abs diff 0.0), unmerged and
    merged; the merged weights are PEFT's merge_and_unload's, bit for bit."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = apply_lora(native_model("llama3"), list(PEFT_TARGETS), rank=4, alpha=8, use_dora=True)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(PEFT_TARGETS.values()), use_dora=True)
    fresh = get_peft_model(hf_model("llama3"), config)
    theirs = fresh.state_dict()["base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector.default.weight"]
    assert torch.equal(lora_modules(model)["layers.1.mlp.w2"].lora_magnitude, theirs)
    assert sorted(k for k in lora_state_dict(model) if k.startswith("layers.0.attn.q")) == [
        "layers.0.attn.q_proj.lora_a", "layers.0.attn.q_proj.lora_b", "layers.0.attn.q_proj.lora_magnitude"
    ]  # fmt: skip
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)

    _trained(model, seed=1)
    save_adapter(model, tmp_path, base_model_name_or_path=str(hf_dir("llama3")))
    assert json.loads((tmp_path / "adapter_config.json").read_text())["use_dora"] is True
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    magnitude = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
    assert magnitude.shape == (64,) and magnitude.dtype == torch.float32

    peft_model = PeftModel.from_pretrained(hf_model("llama3"), tmp_path).eval()
    assert torch.equal(_logits(peft_model, hf=True), _logits(model))
    reloaded = load_adapter(native_model("llama3"), tmp_path)
    assert torch.equal(_logits(reloaded), _logits(model))

    merge_lora(reloaded)
    merged = peft_model.merge_and_unload()
    assert torch.equal(_logits(merged, hf=True), _logits(reloaded))
    ours = reloaded.state_dict()
    assert torch.equal(
        ours["layers.0.attn.q_proj.weight"], merged.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )
    unmerge_lora(reloaded)  # W / (m / ||W + dW||) - dW: the base back to float32 rounding
    base = native_model("llama3").state_dict()["layers.0.attn.q_proj.weight"]
    assert 0 < (reloaded.state_dict()["layers.0.attn.q_proj.weight"] - base).abs().max().item() <= 3e-8


def _peft_dora(family: str, out: Path, base: torch.nn.Module | None = None, **kwargs) -> torch.nn.Module:
    """A PEFT DoRA model with trained-looking adapters, saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(base or hf_model(family), LoraConfig(r=4, lora_alpha=8, use_dora=True, **kwargs))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize(
    ("family", "targets"), [("llama3", ["k_proj", "o_proj", "up_proj"]), ("phi3", ["qkv_proj", "gate_up_proj"])]
)
def test_peft_dora_adapter_loads_in_ckptkit(family: str, targets: list[str], tmp_path: Path) -> None:
    """PEFT's DoRA adapters (Phi-3's fused modules too: the magnitude splits by rows like B)
    give PEFT's logits in ckptkit exactly (float32), merged too, and save back as the same
    tensors."""
    peft_model = _peft_dora(family, tmp_path / "peft", target_modules=targets)
    model = load_adapter(native_model(family), tmp_path / "peft")
    assert torch.equal(_logits(peft_model, hf=True), _logits(model))
    prepare_for_peft(model)
    save_adapter(model, tmp_path / "again")
    theirs, ours = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("peft", "again"))
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    merge_lora(model)
    assert torch.equal(_logits(peft_model.merge_and_unload(), hf=True), _logits(model))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_merge_of_a_dora_adapter_is_peft_s_merge(dtype: str, tmp_path: Path) -> None:
    """``ckptkit merge`` of a PEFT DoRA adapter gives PEFT's merge_and_unload bit for bit, on a
    float32 base and on a bfloat16 one (float32 adapter, sum and norm in float32, one rounding)."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from ckptkit.cli import app
    from ckptkit.convert import ConvertOptions, convert

    def base_model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=getattr(torch, dtype))

    convert(hf_dir("llama2"), tmp_path / "base", ConvertOptions("hf", dtype=dtype))
    peft_model = _peft_dora("llama2", tmp_path / "adapter", base_model(), target_modules=["q_proj", "down_proj"])
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=getattr(torch, dtype)).state_dict()
    theirs = peft_model.merge_and_unload().state_dict()
    original = base_model().state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert sum(not torch.equal(theirs[k], original[k]) for k in original) == 4  # q and down, 2 layers


def test_dora_refusals_are_one_line(tmp_path: Path) -> None:
    from ckptkit.train.lora import add_lora
    from ckptkit.train.schema import LoRAConfig
    from ckptkit.train.trainable import LoRAAdapters

    from train_helpers import fixture_config

    model = apply_lora(native_model("llama3"), ["q"], rank=2, use_dora=True)
    add_lora(model, {"layers.0.attn.v_proj": 2}, alpha=16.0)  # plain LoRA beside DoRA
    with pytest.raises(CkptkitError, match="one lora_alpha, lora_dropout, use_rslora and use_dora"):
        save_adapter(model, tmp_path)
    lora = LoRAConfig(targets=["q", "experts"], use_dora=True)
    with pytest.raises(CkptkitError, match="no DoRA for experts") as info:
        LoRAAdapters(lora).check(fixture_config("qwen3_moe"))
    assert "\n" not in str(info.value)


def test_lora_finetune_with_use_dora_trains_magnitudes_peft_loads(tmp_path: Path) -> None:
    """``lora.use_dora: true`` (with dropout): the magnitudes train, the adapter loads in PEFT,
    and PEFT's merge_and_unload of it (float32, rounded to the stored dtype) is the recipe's
    merged model bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import recipe_entry

    out = tmp_path / "out"
    overrides = [
        "epochs=1",
        "max_steps_per_epoch=1",
        "batch_size=2",
        "quiet=true",
        "lora.use_dora=true",
        "lora.dropout=0.1",
    ]
    recipe_entry("lora_finetune")(
        load_config("tiny_lora", [*overrides, "lora.targets=[q,v,down]", f"checkpointer.output_dir={out}"])
    )
    adapter = out / "epoch_0" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    base = AutoModelForCausalLM.from_pretrained(hf_dir("llama2"), dtype=torch.float32)
    stored = AutoModelForCausalLM.from_pretrained(hf_dir("llama2")).state_dict()
    key = "model.layers.1.self_attn.q_proj"
    magnitude = load_file(adapter / "adapter_model.safetensors")[f"base_model.model.{key}.lora_magnitude_vector"]
    assert not torch.equal(magnitude, torch.linalg.norm(base.state_dict()[f"{key}.weight"], dim=1))  # it trained
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(out / "epoch_0").state_dict()
    assert ours.keys() == merged.keys()
    assert all(torch.equal(v, merged[k].to(stored[k].dtype)) for k, v in ours.items())
