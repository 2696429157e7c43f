"""QDoRA: DoRA on an NF4 base. The magnitudes start from the row norms of the dequantized NF4
weights (as PEFT's DoRA on a 4-bit base does), the adapter loads in PEFT on that dequantized
base with the trained model's outputs, and the merge follows QLoRA's rule (``merge_base``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit import open_checkpoint
from ckptkit.train import nf4
from ckptkit.train.config import load_config, parse_config
from ckptkit.train.loop import RECIPES
from ckptkit.train.lora import apply_lora
from ckptkit.train.peft_io import load_adapter
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.trainable import LoRAAdapters
from ckptkit.train.transformer import build_model

pytest.importorskip("torchao")
from test_qlora import base  # noqa: E402,F401  (the one-layer Llama NF4 can block)
from torchao.quantization import to_nf4  # noqa: E402  (the reference: torchao's own API)

TARGETS = ["q_proj", "v_proj"]


def _train(folder: Path, out: Path, *extra: str) -> Path:
    overrides = [
        f"checkpointer.checkpoint_dir={folder}", f"checkpointer.output_dir={out}", "epochs=1", "max_steps_per_epoch=2",
        "lora.targets=[q,v]", "quiet=true", "quantize_base=nf4", "lora.use_dora=true", "batch_size=4", *extra,
    ]  # fmt: skip
    recipe_entry("lora_finetune")(load_config("tiny_lora", overrides))
    return sorted(out.glob("epoch_*"))[-1]


def dequantized_hf(folder: Path) -> torch.nn.Module:
    """transformers' model of ``folder`` with every decoder linear its dequantized NF4 weight (torchao)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(to_nf4(module.weight, 64, 256).get_original_weight())
    return model.eval()


@pytest.fixture(scope="module")
def trained(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return _train(base, tmp_path_factory.mktemp("qdora"))


def test_qdora_magnitudes_start_at_peft_s_on_the_dequantized_nf4_base(base: Path) -> None:  # noqa: F811
    """The magnitude the recipe starts from is PEFT's ``lora_magnitude_vector`` of DoRA on
    the dequantized NF4 weights, not the 16-bit rows' norms."""
    from peft import LoraConfig, get_peft_model

    raw = load_config("tiny_lora", ["quantize_base=nf4", "lora.use_dora=true"])
    cfg = parse_config(raw, RECIPES["lora_finetune"][0])
    with open_checkpoint(base) as ckpt:
        model = build_model(ckpt.config, device="meta")
        apply_lora(model, ["q", "v"], use_dora=True)
        read = LoRAAdapters(cfg.lora).source(model, lambda k: ckpt.tensors[k].get())
        ours = {n: read(f"layers.0.attn.{n}.lora_magnitude") for n in TARGETS}
        weights = {n: ckpt.tensors[f"layers.0.attn.{n}.weight"].get().float() for n in TARGETS}
    sixteen = {n: torch.linalg.norm(w, dim=1) for n, w in weights.items()}
    peft = get_peft_model(dequantized_hf(base), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, use_dora=True))
    for n in TARGETS:
        theirs = peft.base_model.model.model.layers[0].self_attn.get_submodule(n).lora_magnitude_vector["default"]
        assert torch.equal(ours[n], theirs.weight.detach())
        assert not torch.equal(ours[n], sixteen[n])


def test_qdora_adapter_loads_in_peft_on_the_dequantized_base_and_merges_as_peft(
    base: Path,  # noqa: F811
    trained: Path,
) -> None:
    """The trained model (NF4 base, DoRA) and PEFT with its adapter on the dequantized base give
    the same logits; the merged checkpoint (merge_base nf4) is PEFT's ``merge_and_unload`` of it."""
    from peft import PeftModel

    adapter = load_file(trained / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_magnitude_vector") for k in adapter)
    with open_checkpoint(base) as ckpt:
        native = build_model(ckpt.config)
        native.load_state_dict({k: t.get() for k, t in ckpt.tensors.items()})
    load_adapter(native, trained / "adapter")
    nf4.quantize_base(native)
    peft = PeftModel.from_pretrained(dequantized_hf(base), trained / "adapter").eval()
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (peft(ids).logits - native.eval()(ids)).abs().max().item()
    assert diff == 0.0  # measured: the same float32 arithmetic
    merged = load_file(trained / "model.safetensors")
    theirs = peft.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name
