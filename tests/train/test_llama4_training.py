"""The native decoder on Llama 4 (text model and Meta's multimodal release): logits as
transformers' eager float32 ones with its interleaved experts (top-1 sigmoid router scaling the
experts' input, a shared expert), NoPE layers with the attention temperature, chunked
attention, q/k L2 norms and the complex rope layout; routing as transformers' (ties too);
KV-cached greedy decoding; full and LoRA fine-tuning written in the input's layout (the vision
tower of the multimodal release carried), the adapter loading in PEFT.

The fixtures' configs make every mechanism decide on short inputs: chunks of 5 positions, a
temperature floor of 4 (the NoPE layers' scale changes at positions 3, 7, 11...), NoPE and MoE
on layers 1 and 3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import raw_layout
from train_helpers import FIXTURES

NAMES = ["llama4-text", "llama4"]
# Max |logits difference| measured against transformers' eager attention (float32): 5.4e-7 on
# the 24 tokens below (right-padded: 4.8e-7), 6.2e-7 over 15 inputs of 11 to 40 tokens (SDPA's
# sums against eager's matmul-softmax-matmul); cached decoding 3.3e-7 from transformers', 5.7e-7
# from the full forward; a left-padded row 3.6e-7 from the row alone.
PARITY = 7e-7
SHORT = ["epochs=1", "max_steps_per_epoch=2", "batch_size=2", "quiet=true"]


def _reference(src: Path) -> torch.nn.Module:
    import transformers

    multimodal = "text_config" in json.loads((src / "config.json").read_text())
    cls = transformers.Llama4ForConditionalGeneration if multimodal else transformers.Llama4ForCausalLM
    return cls.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()


def _ours(src: Path) -> torch.nn.Module:
    from ckptkit.train.transformer import load_model

    return load_model(str(src), dtype=torch.float32)


def _ids(seed: int = 0, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 372, (2, length), generator=torch.Generator().manual_seed(seed))


def _logits(theirs: torch.nn.Module, ids: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
    """transformers' logits; of the multimodal model's language model (whose forward with text
    alone fails in transformers 5.24: ``image_outputs``), with PEFT's layers where adapted."""
    import transformers

    model = theirs.get_base_model() if hasattr(theirs, "get_base_model") else theirs
    if isinstance(model, transformers.Llama4ForConditionalGeneration):
        model = model.language_model
    return model(ids, **kw).logits


def _diff(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor, **kw: torch.Tensor) -> float:
    """Max |logits difference| over the real tokens."""
    with torch.no_grad():
        diff = (ours(ids, **kw) - _logits(theirs, ids, **kw)).abs()
    return diff[kw["attention_mask"].bool()].max().item() if "attention_mask" in kw else diff.max().item()


@pytest.mark.parametrize("name", NAMES)
def test_native_logits_match_transformers(name: str) -> None:
    src = FIXTURES / "hf" / name
    ours, theirs = _ours(src), _reference(src)
    assert _diff(ours, theirs, _ids()) <= PARITY
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0  # right padding: positions as unpadded
    assert _diff(ours, theirs, _ids(1), attention_mask=mask) <= PARITY


def test_each_llama4_mechanism_changes_the_logits(tmp_path: Path) -> None:
    """Each feature switched off in the config, on both sides: the logits move (so the parity
    above covers it) and stay transformers'."""
    src = FIXTURES / "hf" / "llama4-text"
    base = _ours(src)(_ids()).detach()
    changes = {
        "attn_temperature_tuning": False,
        "use_qk_norm": False,
        "attention_chunk_size": 64,
        "no_rope_layers": [1, 1, 1, 1],
    }
    for key, value in changes.items():
        out = shutil.copytree(src, tmp_path / key)
        doc = json.loads((out / "config.json").read_text())
        doc[key] = value
        if key == "no_rope_layers":
            doc["layer_types"] = ["chunked_attention"] * 4
        (out / "config.json").write_text(json.dumps(doc))
        ours = _ours(out)
        with torch.no_grad():
            assert (ours(_ids()) - base).abs().max().item() > 1e-3, key
        assert _diff(ours, _reference(out), _ids()) <= PARITY, key


def test_routing_is_transformers_with_ties(tmp_path: Path) -> None:
    """Top 1 and top 2 of 4 experts: in layer 1 the router's rows of experts 1 and 2 equal
    expert 0's, so the three tie for every token; layer 3 routes by its trained weights. Each
    token goes to transformers' experts, scaled as transformers scales them."""
    from ckptkit.train.experts import Llama4MoE

    for k in (1, 2):
        src = shutil.copytree(FIXTURES / "hf" / "llama4-text", tmp_path / str(k))
        doc = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(doc | {"num_experts_per_tok": k}))
        ours, theirs = _ours(src), _reference(src)
        moe = [layer.mlp for layer in ours.layers if isinstance(layer.mlp, Llama4MoE)]
        routers = [layer.feed_forward.router for layer in theirs.model.layers if layer.is_moe_layer]
        assert len(moe) == len(routers) == 2
        scores: list[torch.Tensor] = []
        keep = scores.append
        with torch.no_grad():
            moe[0].router.weight[1:3] = moe[0].router.weight[0]
            for mine, router in zip(moe, routers, strict=True):
                router.weight.copy_(mine.router.weight)
                router.register_forward_hook(lambda _m, _a, out, keep=keep: keep(out[0]))  # (scores, logits)
            assert _diff(ours, theirs, _ids(3)) <= PARITY
        for mine, score in zip(moe, scores, strict=True):
            assert mine.chosen is not None
            chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(1, mine.chosen, True)
            assert torch.equal(chosen, score > 0)  # the chosen experts (sigmoid > 0), the others 0
        first, second = (m.chosen for m in moe)
        assert first is not None and second is not None
        assert (first < 3).any() and len(set(second.flatten().tolist())) > 1  # ties decided; trained routing


def test_cached_greedy_decoding_matches_transformers_generate() -> None:
    """8 prompt tokens and 20 new ones (positions up to 27: six chunks, the temperature
    stepping 7 times): tokens equal transformers' generate, every cached step's logits its
    logits and the full forward's of the final sequence."""
    from ckptkit.train.generation import generate

    src = FIXTURES / "hf" / "llama4-text"
    ours, theirs = _ours(src), _reference(src)
    steps: list[torch.Tensor] = []
    ours.register_forward_hook(lambda _m, _args, out: steps.append(out[:, -1]))
    prompt = _ids(4, 8)[:1]
    tokens = generate(ours, prompt, 20)
    ref = theirs.generate(
        prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(tokens, ref.sequences)
    cached = torch.stack(steps, dim=1)
    assert (cached - torch.stack(ref.logits, dim=1)).abs().max().item() <= PARITY
    with torch.no_grad():
        full = ours(tokens[:, :-1])[:, 7:]
    assert (cached - full).abs().max().item() <= PARITY


def test_left_padded_row_has_its_unpadded_logits() -> None:
    """Chunks and temperature go by position: a row left-padded by 5 gives the logits it gives
    alone, in one forward and when decoding from the cache."""
    from ckptkit.train.generation import generate

    model = _ours(FIXTURES / "hf" / "llama4-text")
    ids = _ids(5, 19)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        padded = model(ids.masked_fill(mask == 0, 0), attention_mask=mask)[1, 5:]
        alone = model(ids[1:, 5:])[0]
    assert (padded - alone).abs().max().item() <= PARITY
    batch = generate(model, ids.masked_fill(mask == 0, 0), 12, attention_mask=mask)
    assert torch.equal(batch[1, 5:], generate(model, ids[1:, 5:], 12)[0])


@pytest.fixture(scope="module")
def float32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both fixtures in float32 (merges compared without bf16 rounding)."""
    root = tmp_path_factory.mktemp("float32")
    for name in NAMES:
        convert(FIXTURES / "hf" / name, root / name, ConvertOptions("hf", dtype="float32"))
    return {name: root / name for name in NAMES}


def _run(recipe: str, config: str, src: Path, out: Path, *overrides: str) -> None:
    args = [*SHORT, *overrides, f"checkpointer.checkpoint_dir={src}", f"checkpointer.output_dir={out}"]
    recipe_entry(recipe)(load_config(config, args))


def _layout(root: Path) -> dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    return {f: [(k, t.dtype, tuple(t.shape)) for k, t in tensors] for f, tensors in raw_layout(root).items()}


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    return {k: t for tensors in raw_layout(root).values() for k, t in tensors}


@pytest.mark.parametrize("name", NAMES)
def test_full_fine_tuning_writes_the_input_layout(name: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / name
    _run("full_finetune", "tiny_full", src, tmp_path)
    out = tmp_path / "epoch_0"
    assert _layout(out) == _layout(src)  # files, names in order, dtypes, shapes (the vision tower too)
    before, after = _tensors(src), _tensors(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    vision = {k for k in before if not k.startswith(("model.", "language_model.", "lm_head."))}
    assert not changed & vision and len(changed) == len(before) - len(vision)  # every text tensor trained
    assert any(k.endswith("experts.gate_up_proj") for k in changed)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    _reference(out)  # loads in transformers


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapter_loads_in_peft_and_merged_output_equals_peft_merge(
    name: str, float32: dict[str, Path], tmp_path: Path
) -> None:
    """LoRA on attention, the dense MLPs, the shared experts, the stacked experts and the router:
    the adapter in PEFT gives the native model's logits, the merged output (in the input's
    layout, the vision tower as read) is PEFT's merge, ``ckptkit merge``'s too."""
    from peft import PeftModel

    from ckptkit.train.peft_io import load_adapter

    base = float32[name]
    _run("lora_finetune", "tiny_lora", base, tmp_path, "lora.targets=[q,k,v,o,gate,up,down,experts,router]")
    out = tmp_path / "epoch_0"
    ids = _ids(6, 13)
    peft = PeftModel.from_pretrained(_reference(base), out / "adapter").eval()
    ours = load_adapter(_ours(base), out / "adapter")
    with torch.no_grad():
        want = _logits(peft, ids)
        assert (ours(ids) - want).abs().max().item() <= PARITY
        assert (want - _ours(base)(ids)).abs().max().item() > 1e-3
    assert _layout(out) == _layout(base)
    merged = _reference(out)
    theirs = peft.merge_and_unload().state_dict()
    worst = max((v - theirs[k]).abs().max().item() for k, v in merged.state_dict().items())
    assert worst < 1e-6  # float32 rounding of W + s * B @ A
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert {"feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"} <= set(config["target_parameters"])
    experts = [k for k in theirs if k.endswith("experts.gate_up_proj")]
    assert experts and all(torch.equal(merged.state_dict()[k], theirs[k]) for k in experts)
    assert not torch.equal(_tensors(out)[experts[0]], _tensors(base)[experts[0]])
    from ckptkit.train.export import merge_adapter_into_checkpoint

    merge_adapter_into_checkpoint(base, out / "adapter", tmp_path / "merged")
    assert all(torch.equal(t, _tensors(out)[k]) for k, t in _tensors(tmp_path / "merged").items())
    before, after = _tensors(base), _tensors(out)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(("vision_model.", "multi_modal")))
    with torch.no_grad():
        assert (_logits(merged, ids) - want).abs().max().item() <= PARITY


def test_llama4_aux_loss_and_dropout_on_its_experts_are_refused(tmp_path: Path) -> None:
    from ckptkit.train.lora_targets import check_targets

    from train_helpers import fixture_config

    with pytest.raises(CkptkitError, match="lora.dropout: PEFT adapts experts as stacked tensors, without dropout"):
        check_targets(["q", "experts"], fixture_config("llama4-text"), dropout=0.1)
    check_targets(["q", "gate", "up", "down", "experts", "router"], fixture_config("llama4-text"))
    with pytest.raises(CkptkitError, match="load-balancing loss of llama4's router is not supported yet"):
        _run("full_finetune", "tiny_full", FIXTURES / "hf" / "llama4-text", tmp_path, "router_aux_loss_coef=0.01")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_peft_made_stacked_expert_adapter_loads_in_ckptkit(tmp_path: Path) -> None:
    """PEFT's own adapter on Llama 4's stacked experts, which transformers does not mark
    [E, in, out] (so PEFT's A is [E * r, 2I] for gate_up_proj): ckptkit's logits are PEFT's."""
    from peft import LoraConfig, get_peft_model

    from ckptkit.train.peft_io import load_adapter

    src = FIXTURES / "hf" / "llama4-text"
    params = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=params, init_lora_weights=False)
    torch.manual_seed(0)
    peft = get_peft_model(_reference(src), config).eval()
    peft.save_pretrained(tmp_path)
    ours, ids = load_adapter(_ours(src), tmp_path), _ids(3, 10)
    with torch.no_grad():
        want = _logits(peft, ids)
        assert (want - _logits(_reference(src), ids)).abs().max().item() > 0.1  # the adapter acts
        assert (ours(ids) - want).abs().max().item() <= PARITY
