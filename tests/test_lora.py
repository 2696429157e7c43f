"""LoRA on the native model: init, freezing, exact merge/unmerge, merged export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.train.export import export_merged, merge_adapter_into_checkpoint
from ckptkit.train.lora import (
    TARGETS,
    LoRALinear,
    apply_lora,
    base_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
)
from ckptkit.train.peft_io import save_adapter

from train_helpers import TOL, hf_dir, native_model, padded_batch

ALL = list(TARGETS)


def _randomize_b(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.05)


def test_init_is_a_no_op_and_only_adapters_train() -> None:
    model = native_model("llama3")
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        before = model(ids, attention_mask=mask)
    apply_lora(model, ALL, rank=4, alpha=8, dropout=0.1)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask), before)  # B = 0
    modules = lora_modules(model)
    assert len(modules) == 7 * model.config.num_layers + 1
    m = modules["layers.0.attn.q_proj"]
    assert (m.lora_b == 0).all() and m.lora_a.abs().max() > 0 and m.scaling == 2.0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{ab}" for n in modules for ab in ("lora_a", "lora_b")}
    # canonical base names are unchanged, so the base state dict still loads as is
    assert set(base_state_dict(model, merged=False)) == set(native_model("llama3").state_dict())


def test_training_step_changes_only_adapters() -> None:
    model = native_model("qwen2")
    apply_lora(model, ["q", "v", "down"], rank=4, alpha=8)
    base = {k: v.clone() for k, v in base_state_dict(model, merged=False).items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids, mask = padded_batch(model.config.vocab_size)
    for _ in range(2):
        logits = model.train()(ids, attention_mask=mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = base_state_dict(model, merged=False)
    assert all(torch.equal(base[k], after[k]) for k in base)
    assert all(m.lora_b.abs().max() > 0 for m in lora_modules(model).values())


@pytest.mark.parametrize("family", ["llama2", "llama3", "qwen2", "gemma", "phi3"])
def test_merge_equals_adapter_and_unmerge_restores(family: str) -> None:
    model = native_model(family)
    targets = [t for t in ALL if t != "output" or not model.config.tie_word_embeddings]
    apply_lora(model, targets, rank=4, alpha=16)
    _randomize_b(model)
    base = {k: v.clone() for k, v in base_state_dict(model, merged=False).items()}
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        unmerged = model(ids, attention_mask=mask)
        merged_weights = base_state_dict(model, merged=True)
        merge_lora(model)
        merged = model(ids, attention_mask=mask)
        assert all(torch.equal(v, merged_weights[k]) for k, v in base_state_dict(model, merged=False).items())
        unmerge_lora(model)
    assert (merged - unmerged).abs()[mask.bool()].max().item() <= TOL
    worst = max((base[k] - v).abs().max().item() for k, v in base_state_dict(model, merged=False).items())
    assert worst <= 1e-6  # float32 rounding of W + dW - dW


def test_bfloat16_base_gets_float32_adapters() -> None:
    model = native_model("llama3", torch.bfloat16)
    apply_lora(model, ["q", "v"], rank=4, alpha=8)
    m = lora_modules(model)["layers.1.attn.v_proj"]
    assert m.weight.dtype == torch.bfloat16 and m.lora_a.dtype == torch.float32
    ids, _ = padded_batch(model.config.vocab_size)
    assert model(ids).dtype == torch.bfloat16


def test_bad_targets_are_one_line_errors() -> None:
    with pytest.raises(CkptkitError, match="unknown LoRA target"):
        apply_lora(native_model("llama3"), ["qkv"])
    with pytest.raises(CkptkitError, match="tied embeddings"):
        apply_lora(native_model("qwen2"), ["output"])
    model = apply_lora(native_model("llama3"), ["q"], layers=[1])
    assert set(lora_modules(model)) == {"layers.1.attn.q_proj"}
    assert isinstance(model.layers[1].attn.q_proj, LoRALinear)
    assert not isinstance(model.layers[0].attn.q_proj, LoRALinear)


def test_export_merged_writes_base_layout_and_reloads(tmp_path: Path) -> None:
    """Merged weights go through save_checkpoint_like: same files, same dtype (bf16)."""
    import ckptkit

    src = hf_dir("llama3")
    model = native_model("llama3")  # float32 copy of the bf16 fixture
    apply_lora(model, ["q", "k", "v", "o", "gate", "up", "down"], rank=4, alpha=8)
    _randomize_b(model, seed=1)
    out = tmp_path / "merged"
    export_merged(model, src, out)

    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in src.glob("*.safetensors"))
    _, reloaded = ckptkit.load_checkpoint(str(out))
    expected = base_state_dict(model, merged=True)
    for k, v in reloaded.items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, expected[k].to(torch.bfloat16)), k

    # The same result straight from a PEFT adapter on disk, without building a model.
    save_adapter(model, tmp_path / "adapter")
    merge_adapter_into_checkpoint(src, tmp_path / "adapter", tmp_path / "merged2")
    _, again = ckptkit.load_checkpoint(str(tmp_path / "merged2"))
    assert all(torch.equal(again[k], reloaded[k]) for k in reloaded)


def test_lora_state_dict_has_only_adapter_tensors() -> None:
    model = apply_lora(native_model("gemma"), ["q", "down"], rank=2)
    keys = set(lora_state_dict(model))
    assert keys == {
        f"layers.{i}.{m}.{ab}" for i in range(2) for m in ("attn.q_proj", "mlp.w2") for ab in ("lora_a", "lora_b")
    }
