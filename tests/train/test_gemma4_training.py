"""Gemma 4 in the native decoder: logits as transformers' (eager attention and experts, float32),
greedy decoding from the KV cache with KV-shared layers, full and LoRA fine-tuning of the causal
LM (``hf/gemma4-text``: per-layer inputs, KV-shared layers with a double-wide MLP) and of the
multimodal release (``hf/gemma4``: experts beside the MLP, a full layer whose values are its
keys, a vision tower carried untouched), adapters loaded by PEFT with the native logits, merged
outputs in the input's layout equal to PEFT's merge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import raw_layout
from train_helpers import FIXTURES

NAMES = ["gemma4-text", "gemma4"]
SHORT = ["epochs=1", "max_steps_per_epoch=2", "batch_size=2", "quiet=true"]
TOWERS = ("model.vision_tower.", "model.embed_vision.")


def _hf(src: Path, name: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of ``src`` (the multimodal one for ``gemma4``), eager attention and
    experts (its default grouped_mm experts sum in another order: 2.0e-6 apart in float32)."""
    import transformers

    auto = transformers.AutoModelForImageTextToText if name == "gemma4" else transformers.AutoModelForCausalLM
    kw = {"attn_implementation": "eager", "experts_implementation": "eager"}
    return auto.from_pretrained(src, dtype=dtype, **kw).eval()


def _ids(seed: int = 0, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 384, (2, length), generator=torch.Generator().manual_seed(seed))


def _run(recipe: str, config: str, *overrides: str) -> None:
    recipe_entry(recipe)(load_config(config, list(overrides)))


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    return {k: t for f in raw_layout(root).values() for k, t in f}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_native_logits_equal_transformers(name: str, dtype: torch.dtype) -> None:
    """Measured: equal bit for bit over 24 tokens (past the window of 5), in float32 and in
    bfloat16 (norms scale in float32 before the cast, as transformers' do). Gemma 4 attends with
    transformers' arithmetic (expanded KV heads, matmul-softmax-matmul): SDPA's float32 sums
    differ by 1e-7, which this fixture's layers (outputs of 0.03 normed back to 1) amplify to 4.2e-5."""
    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / name
    ours, theirs = load_model(str(src), dtype=dtype), _hf(src, name, dtype)
    with torch.no_grad():
        assert torch.equal(ours(_ids()), theirs(_ids()).logits)


@pytest.mark.parametrize("name", NAMES)
def test_every_gradient_matches_transformers(name: str) -> None:
    """The loss's gradient of every trained parameter (the KV-shared layers' reaching the keys and
    values of the layers they read; the router's and experts'). Measured: within 4.8e-6 of
    transformers', 1.7e-6 of the largest entry (backward's sums in another order)."""
    import torch.nn.functional as F

    from ckptkit.models import get_family
    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / name
    ours, theirs = load_model(str(src), dtype=torch.float32).train(), _hf(src, name).train()
    ids = _ids(1)
    for logits in (ours(ids), theirs(ids).logits):
        F.cross_entropy(logits[:, :-1].reshape(-1, 384), ids[:, 1:].reshape(-1)).backward()
    hf = {r.canonical[0]: r.native for r in get_family("gemma4").hf_layout(ours.config).expand(0)}
    params = dict(theirs.named_parameters())
    for key, p in ours.named_parameters():
        want = params[hf[key]].grad
        assert p.grad is not None and want is not None
        diff = (p.grad - want).abs().max().item()
        assert diff <= 5e-6 and diff <= 2e-6 * want.abs().max().item(), key


def test_greedy_decoding_from_the_cache_equals_transformers() -> None:
    """The KV-shared layers attend over the cached keys and values of the last earlier layer of
    their kind, cached rows included: 16 new tokens from a prompt of 8, as transformers' generate."""
    from ckptkit.train.generation import generate
    from ckptkit.train.transformer import load_model

    src = FIXTURES / "hf" / "gemma4-text"
    prompt = torch.randint(3, 384, (2, 8), generator=torch.Generator().manual_seed(3))  # no pad (0): all attended
    ours = generate(load_model(str(src), dtype=torch.float32), prompt, 16)
    want = _hf(src, "gemma4-text").generate(
        prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(ours, want)


@pytest.mark.parametrize("name", NAMES)
def test_full_fine_tuning_writes_the_input_layout_towers_untouched(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    paths = [f"checkpointer.checkpoint_dir={src}", f"checkpointer.output_dir={tmp_path}"]
    _run("full_finetune", "tiny_full", *SHORT, *paths)
    out = tmp_path / "epoch_0"
    before, after = _tensors(src), _tensors(out)
    shapes = {f: [(k, t.dtype, tuple(t.shape)) for k, t in ts] for f, ts in raw_layout(src).items()}
    assert shapes == {f: [(k, t.dtype, tuple(t.shape)) for k, t in ts] for f, ts in raw_layout(out).items()}
    kept = {k for k in before if torch.equal(before[k], after[k])}
    carried = {k for k in before if k.startswith(TOWERS) or k.endswith("layer_scalar")}  # buffers, not trained
    assert kept == carried and (name == "gemma4") == any(k.startswith(TOWERS) for k in carried)
    loaded = _hf(out, name)
    assert loaded.state_dict().keys() == _hf(src, name).state_dict().keys()


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapter_loads_in_peft_and_merged_output_equals_peft_merge(name: str, tmp_path: Path) -> None:
    """Attention and the dense MLP adapted (the KV-shared layers have no k/v to adapt). Measured:
    PEFT's logits and merge equal ckptkit's bit for bit; the multimodal adapter names the text
    model's modules in full, so that PEFT leaves the vision tower's q/k/v/o alone."""
    from peft import PeftModel

    from ckptkit.train.peft_io import load_adapter
    from ckptkit.train.transformer import load_model

    base = tmp_path / "base"
    convert(FIXTURES / "hf" / name, base, ConvertOptions("hf", dtype="float32"))
    _run("lora_finetune", "tiny_lora", *SHORT, "lora.targets=[q,k,v,o,gate,up,down]",
         f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={tmp_path / 'out'}")  # fmt: skip
    out = tmp_path / "out" / "epoch_0"
    targets = json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert all(t.startswith("model.language_model.layers.") for t in targets) if name == "gemma4" else len(targets) == 7

    peft = PeftModel.from_pretrained(_hf(base, name), out / "adapter").eval()
    ours = load_adapter(load_model(str(base), dtype=torch.float32), out / "adapter")
    with torch.no_grad():
        want = peft(_ids(5, 13)).logits
        assert torch.equal(ours(_ids(5, 13)), want)
        assert (want - load_model(str(base), dtype=torch.float32)(_ids(5, 13))).abs().max().item() > 1e-3

    assert raw_layout(out).keys() == raw_layout(base).keys()
    merged, theirs = _hf(out, name).state_dict(), peft.merge_and_unload().state_dict()
    assert merged.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in merged.items())
    before, after = _tensors(base), _tensors(out)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(TOWERS))


def test_lora_on_the_experts_their_loss_and_a_bidirectional_model_are_refused_in_one_line(tmp_path: Path) -> None:
    from ckptkit.train.lora_targets import check_targets
    from ckptkit.train.step import router_aux_weight
    from ckptkit.train.transformer import load_model

    from train_helpers import fixture_config

    with pytest.raises(CkptkitError, match=r"^lora.targets: experts router: LoRA on gemma4's stacked experts"):
        check_targets(["q", "experts", "router"], fixture_config("gemma4"))
    with pytest.raises(CkptkitError, match=r"^lora.targets: gemma4 has no experts; remove experts"):
        check_targets(["experts"], fixture_config("gemma4-text"))
    with pytest.raises(CkptkitError, match=r"load-balancing loss of gemma4's router is not supported yet"):
        router_aux_weight(0.01, fixture_config("gemma4"))
    with pytest.raises(CkptkitError, match=r"router_aux_loss_coef applies to mixture-of-experts models; gemma4 has"):
        router_aux_weight(0.01, fixture_config("gemma4-text"))
    src = shutil.copytree(FIXTURES / "hf" / "gemma4-text", tmp_path / "m")
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "use_bidirectional_attention": "all"}))
    with pytest.raises(CkptkitError, match=r"use_bidirectional_attention 'all' \(not causal\) is not run"):
        load_model(str(src))


def test_the_k_v_google_stores_for_kv_shared_layers_are_carried_not_trained(tmp_path: Path) -> None:
    """Google's small releases store k/v projections and key norms for the KV-shared layers,
    which transformers ignores: the native model holds them as buffers (no gradient, no LoRA),
    its logits are the fixture's, and full fine-tuning writes them back as read."""
    from safetensors.torch import load_file, save_file

    from ckptkit.train.transformer import load_model

    src = shutil.copytree(FIXTURES / "hf" / "gemma4-text", tmp_path / "src")
    gen = torch.Generator().manual_seed(4)
    shapes = {}
    for i, d in ((2, 12), (3, 16)):  # layer 2 sliding (head_dim 12), layer 3 full (16); one KV head
        a = f"model.layers.{i}.self_attn."
        shapes |= {a + "k_proj.weight": (d, 40), a + "v_proj.weight": (d, 40), a + "k_norm.weight": (d,)}
    added = {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in shapes.items()}
    index = json.loads((src / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    save_file({**load_file(src / last), **added}, src / last, metadata={"format": "pt"})
    index["weight_map"] |= dict.fromkeys(added, last)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    model = load_model(str(src), dtype=torch.float32)
    trained = {n for n, _ in model.named_parameters()}
    assert "layers.3.attn.k_proj.weight" in model.state_dict() and not any(".3.attn.k" in n for n in trained)
    with torch.no_grad():
        assert torch.equal(model(_ids()), load_model(str(FIXTURES / "hf" / "gemma4-text"), dtype=torch.float32)(_ids()))
    paths = [f"checkpointer.checkpoint_dir={src}", f"checkpointer.output_dir={tmp_path / 'out'}"]
    _run("full_finetune", "tiny_full", *SHORT, *paths)
    after = _tensors(tmp_path / "out" / "epoch_0")
    assert all(torch.equal(after[k], v) for k, v in added.items())
