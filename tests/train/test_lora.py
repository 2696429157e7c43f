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


@pytest.mark.parametrize(
    ("dtype", "adapter"),
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float16, torch.float32),
     (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_a_wrapped_linear_is_that_linear_until_b_moves(dtype: torch.dtype, adapter: torch.dtype) -> None:
    """The wrapper shares the linear's weight and bias (frozen), adds trainable A (r, in) and
    B (out, r) in float32 for half-precision bases and the base's dtype otherwise, no dropout
    unless asked, and gives the linear's exact output while B is zero."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5, bias=True, dtype=dtype)
    lora = LoRALinear.from_linear(linear, rank=2, alpha=4)
    assert lora.weight.data_ptr() == linear.weight.data_ptr() and lora.bias.data_ptr() == linear.bias.data_ptr()
    assert not lora.weight.requires_grad and not lora.bias.requires_grad
    assert lora.lora_a.requires_grad and lora.lora_b.requires_grad
    assert (lora.lora_a.dtype, lora.lora_b.dtype) == (adapter, adapter)
    assert lora.lora_a.shape == (2, 6) and lora.lora_b.shape == (5, 2) and not lora.lora_b.any()
    assert isinstance(lora.dropout, torch.nn.Identity) and lora.merged is False and lora.scaling == 2.0
    x = torch.randn(3, 6).to(dtype)
    assert torch.equal(lora.train()(x), linear(x))


def test_lora_linear_built_directly() -> None:
    plain = LoRALinear(6, 5, rank=4, alpha=8)
    assert plain.bias is None and not plain.weight.requires_grad and plain.lora_a.dtype == torch.float32
    assert isinstance(plain.dropout, torch.nn.Identity) and plain.scaling == 2.0 and plain.merged is False
    wide = LoRALinear(6, 5, rank=4, alpha=8, dropout=0.25, bias=True, use_rslora=True, dtype=torch.float64)
    assert wide.weight.dtype == wide.lora_b.dtype == torch.float64 and not wide.bias.requires_grad
    assert isinstance(wide.dropout, torch.nn.Dropout) and wide.dropout.p == 0.25 and wide.scaling == 4.0  # 8 / sqrt 4
    with pytest.raises(CkptkitError, match=r"^LoRA rank must be positive, got 0$"):
        LoRALinear(6, 5, rank=0, alpha=8)


def test_apply_lora_defaults_are_q_and_v_rank_8_alpha_16() -> None:
    model = apply_lora(native_model("llama3"))
    modules = lora_modules(model)
    assert sorted(modules) == [f"layers.{i}.attn.{p}_proj" for i in (0, 1) for p in ("q", "v")]
    assert all(m.rank == 8 and m.scaling == 2.0 and isinstance(m.dropout, torch.nn.Identity) for m in modules.values())
    canonical = lora_modules(apply_lora(native_model("llama3"), ["q_proj", "w2"]))  # canonical leaf names too
    assert (
        set(canonical) == set(lora_modules(apply_lora(native_model("llama3"), ["q", "down"]))) and len(canonical) == 4
    )


def test_lora_mistakes_are_one_line_errors_naming_the_module() -> None:
    from ckptkit.train.lora import add_lora

    with pytest.raises(
        CkptkitError,
        match=r"^unknown LoRA target 'qkv'; choose from q, k, v, o, gate, up, down, output, experts, router, "
        r"q_a, q_b, kv_a, kv_b, in_proj_qkvz, in_proj_ba, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj$",
    ):
        apply_lora(native_model("llama3"), ["qkv"])
    with pytest.raises(CkptkitError, match=r"^LoRA on the output projection is not supported for tied embeddings$"):
        apply_lora(native_model("qwen2"), ["output"])
    with pytest.raises(CkptkitError, match=r"^no module matches LoRA targets \['q_proj', 'w2'\]$"):
        apply_lora(native_model("llama3"), ["q", "down"], layers=[7])
    with pytest.raises(CkptkitError, match=r"^model has no module 'layers.9.attn.q_proj' to put a LoRA adapter on$"):
        add_lora(native_model("llama3"), {"layers.9.attn.q_proj": 2}, 4.0)
    with pytest.raises(CkptkitError, match=r"^layers.0.attn.q_proj already has a LoRA adapter$"):
        add_lora(apply_lora(native_model("llama3"), ["q"]), {"layers.0.attn.q_proj": 2}, 4.0)
    with pytest.raises(CkptkitError, match=r"^layers.0.attn is not a linear layer; LoRA supports linear layers only$"):
        add_lora(native_model("llama3"), {"layers.0.attn": 2}, 4.0)


def test_base_state_dict_merges_by_default_in_the_weights_dtype() -> None:
    """bf16 weights: merged in float32, rounded once to bf16, as PEFT's merge then a cast gives."""
    from ckptkit.train.lora import merged_weight

    model = apply_lora(native_model("llama3", torch.bfloat16), ["q"], rank=4, alpha=8)
    _randomize_b(model)
    m = lora_modules(model)["layers.0.attn.q_proj"]
    state = base_state_dict(model)
    expected = (m.weight.float() + (m.lora_b.float() @ m.lora_a.float()) * 2.0).to(torch.bfloat16)
    assert state["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(state["layers.0.attn.q_proj.weight"], expected)
    assert torch.equal(merged_weight(m.weight, m.lora_a, m.lora_b, m.scaling), expected)
    assert not any(k.endswith((".lora_a", ".lora_b")) for k in state)


def test_a_model_that_is_not_ckptkit_s_is_named_in_one_line() -> None:
    from ckptkit.train.lora import decoder_layers, model_config

    with pytest.raises(CkptkitError, match=r"^Linear is not a ckptkit model \(no ModelConfig\)$"):
        model_config(torch.nn.Linear(2, 2))
    with pytest.raises(CkptkitError, match=r"^Linear is not a ckptkit model \(no decoder layers\)$"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_adapters_start_as_peft_s_a_kaiming_uniform_and_b_zero() -> None:
    """PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5)), B = 0."""
    torch.manual_seed(0)
    lora = LoRALinear(512, 8, rank=64, alpha=16)
    bound = 1 / 512**0.5
    assert lora.lora_a.abs().max().item() <= bound and lora.lora_a.abs().max().item() > 0.999 * bound
    assert abs(lora.lora_a.std().item() - bound / 3**0.5) < 0.01 * bound and not lora.lora_b.any()


def test_add_lora_defaults_and_a_chosen_adapter_dtype() -> None:
    from ckptkit.train.lora import add_lora, decoder_layers

    model = add_lora(native_model("llama3"), {"layers.0.attn.q_proj": 4}, 8.0)
    (m,) = lora_modules(model).values()
    assert m.scaling == 2.0 and isinstance(m.dropout, torch.nn.Identity) and m.lora_a.dtype == torch.float32
    wide = lora_modules(apply_lora(native_model("llama3"), ["v"], rank=2, lora_dtype=torch.float64))
    assert {w.lora_a.dtype for w in wide.values()} == {torch.float64} == {w.lora_b.dtype for w in wide.values()}
    assert decoder_layers(model) is model.layers


def test_adapters_live_on_the_base_s_device_and_a_meta_base_allocates_nothing() -> None:
    """On the meta device (how a model too big for memory is wrapped before loading) every tensor
    stays on meta: wrapping a 2^24 x 2^24 linear (a PiB in float32) allocates no real storage."""
    direct = LoRALinear(6, 5, rank=2, alpha=4, bias=True, device="meta")
    assert all(t.is_meta for t in (direct.weight, direct.bias, direct.lora_a, direct.lora_b))
    huge = torch.nn.Linear(2**24, 2**24, bias=True, device="meta")
    lora = LoRALinear.from_linear(huge, rank=2, alpha=4)
    assert all(t.is_meta for t in (lora.weight, lora.bias, lora.lora_a, lora.lora_b))
    assert lora.weight.shape == (2**24, 2**24) and lora.bias.shape == (2**24,)
    assert lora.lora_a.shape == (2, 2**24) and lora.lora_b.shape == (2**24, 2)
    fresh = LoRALinear(6, 5, rank=2, alpha=4, device="meta")
    fresh.reset_lora(torch.device("meta"), torch.float64)
    assert fresh.lora_a.is_meta and fresh.lora_b.is_meta and fresh.lora_b.dtype == torch.float64


def test_expert_projections_are_targeted_by_experts_only() -> None:
    """An expert's w1/w3/w2 takes an adapter with ``experts``, never with the dense MLP's
    ``gate``/``up``/``down`` (qwen3_moe's layer 1 is dense), wherever the experts sit."""
    from ckptkit.train.lora import targeted

    linears = [n for n, m in native_model("qwen3_moe").named_modules() if isinstance(m, torch.nn.Linear)]
    experts = sorted(n for n in linears if ".experts." in n)
    dense = sorted(n for n in linears if n.rsplit(".", 1)[-1] in ("w1", "w3", "w2") and ".experts." not in n)
    assert len(experts) == 24 and dense == ["layers.1.mlp.w1", "layers.1.mlp.w2", "layers.1.mlp.w3"]
    assert sorted(lora_modules(apply_lora(native_model("qwen3_moe"), ["gate", "up", "down"]))) == dense
    assert sorted(lora_modules(apply_lora(native_model("qwen3_moe"), ["experts"]))) == experts
    assert targeted("experts.0.w1", {"experts"}) and not targeted("experts.0.w1", {"w1"})


def test_a_rank_1_adapter_is_allowed() -> None:
    """PEFT accepts any r > 0, 1 included; the update is then alpha * b a^T."""
    lora = LoRALinear(6, 5, rank=1, alpha=8)
    assert lora.lora_a.shape == (1, 6) and lora.scaling == 8.0


def test_dropout_in_training_masks_the_adapter_input_as_peft_s_layer_does() -> None:
    """lora_dropout > 0 in train mode: the same output as PEFT's ``lora.Linear`` drawing its
    mask from the same RNG state, bit for bit, and not the dropout-free output; eval mode
    drops nothing."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 12, bias=True)
    ours = LoRALinear.from_linear(torch.nn.Linear(16, 12, bias=True), rank=4, alpha=8, dropout=0.5)
    ours.load_state_dict(linear.state_dict(), strict=False)
    with torch.no_grad():
        ours.lora_b.copy_(torch.randn(12, 4))
    host = torch.nn.Sequential()
    host.add_module("proj", linear)
    peft = get_peft_model(host, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["proj"]))
    theirs = peft.base_model.model.proj
    with torch.no_grad():
        theirs.lora_A["default"].weight.copy_(ours.lora_a)
        theirs.lora_B["default"].weight.copy_(ours.lora_b)
    x = torch.randn(5, 16)
    with torch.no_grad():
        undropped = ours.eval()(x)
        assert torch.equal(theirs.eval()(x), undropped)
        ours.train(), theirs.train()
        torch.manual_seed(1)
        dropped = ours(x)
        torch.manual_seed(1)
        assert torch.equal(theirs(x), dropped)
        torch.manual_seed(1)
        mask = torch.nn.functional.dropout(torch.ones_like(x), 0.5)  # the mask nn.Dropout draws, scaled by 2
        expected = linear(x) + (x * mask) @ ours.lora_a.T @ ours.lora_b.T * ours.scaling
        assert torch.equal(dropped, expected)
        assert (dropped - undropped).abs().max().item() > 0.1
