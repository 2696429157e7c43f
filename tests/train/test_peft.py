"""PEFT-format adapters: ckptkit -> peft.PeftModel and peft -> ckptkit give the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.train.generation import generate_text
from ckptkit.train.lora import apply_lora, lora_modules, merge_lora
from ckptkit.train.lora_targets import check_targets
from ckptkit.train.peft_io import load_adapter, prepare_for_peft, save_adapter

from train_helpers import TOL, hf_dir, hf_model, native_model, padded_batch

ALL = ["q", "k", "v", "o", "gate", "up", "down", "output"]
HF_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.05)


def _peft_saved(family: str, out: Path, seed: int = 0, **lora_kwargs) -> torch.nn.Module:
    """A PEFT LoRA model on the HF fixture with non-zero B, saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(family), LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return model.eval()


def _logits(model: torch.nn.Module, family: str, hf: bool = False) -> torch.Tensor:
    ids, mask = padded_batch(384, seed=21)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        if hf:
            return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
        return model(ids, attention_mask=mask)[mask.bool()]


@pytest.mark.parametrize("family", ["llama2", "llama3", "qwen2", "mistral", "gemma"])
def test_ckptkit_adapter_loads_in_peft(family: str, tmp_path: Path) -> None:
    from peft import PeftModel

    model = native_model(family)
    targets = [t for t in ALL if t != "output" or not model.config.tie_word_embeddings]
    apply_lora(model, targets, rank=4, alpha=8)
    _randomize(model, seed=1)
    save_adapter(model, tmp_path, base_model_name_or_path=str(hf_dir(family)))

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    expected_targets = HF_ALL + (["lm_head"] if "output" in targets else [])
    assert config["target_modules"] == sorted(expected_targets)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert config["base_model_name_or_path"] == str(hf_dir(family))

    peft_model = PeftModel.from_pretrained(hf_model(family), tmp_path).eval()
    assert (_logits(peft_model, family, hf=True) - _logits(model, family)).abs().max().item() <= TOL


def test_per_module_ranks_and_rslora_load_in_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    model = native_model("llama3")
    ranks = {"layers.1.mlp.w2": 2, "layers.0.attn.v_proj": 6}
    apply_lora(model, ["v", "down"], rank=4, alpha=8, ranks=ranks, use_rslora=True)
    _randomize(model, seed=4)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["r"] == 4
    assert config["rank_pattern"] == {"model.layers.1.mlp.down_proj": 2, "model.layers.0.self_attn.v_proj": 6}
    peft_model = PeftModel.from_pretrained(hf_model("llama3"), tmp_path).eval()
    assert (_logits(peft_model, "llama3", hf=True) - _logits(model, "llama3")).abs().max().item() <= TOL


def test_dropout_trains_as_in_peft_both_ways(tmp_path: Path) -> None:
    """lora_dropout 0.3 in train mode: ckptkit's model and PEFT's, loaded from the adapter
    ckptkit saved, draw the same masks from the same seed and give the same logits, bit for
    bit; so does ckptkit's model loaded back from that adapter. Eval mode drops nothing."""
    from peft import PeftModel

    model = apply_lora(native_model("llama3"), ALL, rank=4, alpha=8, dropout=0.3)
    _randomize(model, seed=1)
    save_adapter(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_dropout"] == 0.3
    peft_model = PeftModel.from_pretrained(hf_model("llama3"), tmp_path)
    reloaded = load_adapter(native_model("llama3"), tmp_path)

    def logits(train: bool) -> list[torch.Tensor]:
        out = []
        for m, hf in ((model, False), (peft_model, True), (reloaded, False)):
            torch.manual_seed(3)
            out.append(_logits(m.train(train), "llama3", hf))
        return out

    ours, theirs, again = logits(train=True)
    assert torch.equal(ours, theirs) and torch.equal(ours, again)
    undropped = logits(train=False)
    assert all(torch.equal(undropped[0], u) for u in undropped)
    assert (ours - undropped[0]).abs().max().item() > 0.1


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("llama2", {"target_modules": [*HF_ALL, "lm_head"], "rank_pattern": {"down_proj": 16}}),
        ("qwen3_moe", {"target_modules": ["k_proj"], "target_parameters": [
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]}),
    ],
)  # fmt: skip
def test_cli_merge_of_an_rslora_adapter_is_peft_s_merge(family: str, targets: dict, tmp_path: Path) -> None:
    """``ckptkit merge`` of a PEFT adapter saved with ``use_rslora`` (scaling alpha / sqrt(r):
    8 / 2 at r 4, 8 / 4 where rank_pattern says 16; stacked experts and router too) gives
    PEFT's ``merge_and_unload``, bit for bit, on a float32 base (one rounding on both sides)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from ckptkit.cli import app
    from ckptkit.convert import ConvertOptions, convert

    def base_model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)

    convert(hf_dir(family), tmp_path / "base", ConvertOptions("hf", dtype="float32"))
    torch.manual_seed(0)
    peft = get_peft_model(base_model(), LoraConfig(r=4, lora_alpha=8, use_rslora=True, **targets))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    peft.save_pretrained(tmp_path / "adapter")
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output

    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    theirs = PeftModel.from_pretrained(base_model(), tmp_path / "adapter").merge_and_unload().state_dict()
    original = base_model().state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    changed = {k for k in original if not torch.equal(theirs[k], original[k])}
    # every targeted weight moved: llama2 7 per layer x 2 + lm_head; qwen3_moe k_proj x 3, and in its
    # 2 MoE layers the stacked gate_up and down and the router
    assert len(changed) == (15 if family == "llama2" else 9)


def test_adapter_config_has_the_fields_peft_writes(tmp_path: Path) -> None:
    _peft_saved("llama3", tmp_path / "peft", r=4, lora_alpha=8, target_modules=["q_proj"])
    model = apply_lora(native_model("llama3"), ["q"], rank=4, alpha=8)
    save_adapter(model, tmp_path / "ours")
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    ours = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert set(ours) == set(theirs) - {"peft_version"}
    assert {k: v for k, v in ours.items() if k != "base_model_name_or_path"} == {
        k: v for k, v in theirs.items() if k not in ("peft_version", "base_model_name_or_path")
    }
    from safetensors import safe_open

    keys = {}
    for side in ("peft", "ours"):
        with safe_open(str(tmp_path / side / "adapter_model.safetensors"), "pt") as f:
            keys[side] = set(f.keys())
    assert keys["ours"] == keys["peft"]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys["ours"]


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("llama2", {"r": 4, "lora_alpha": 16, "target_modules": HF_ALL + ["lm_head"]}),
        ("llama3", {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
        ("qwen2", {"r": 4, "lora_alpha": 8, "target_modules": HF_ALL}),
        ("phi3", {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]}),
        ("phi3", {"r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "gate_up_proj"]}),  # fused, whole
        ("llama3", {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"], "use_rslora": True}),
        ("gemma", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"], "rank_pattern": {"up_proj": 2}}),
        ("llama2", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "layers_to_transform": [1]}),
    ],
)
def test_peft_adapter_loads_in_ckptkit(family: str, kwargs: dict, tmp_path: Path) -> None:
    peft_model = _peft_saved(family, tmp_path, **kwargs)
    model = load_adapter(native_model(family), tmp_path)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora" not in n)
    diff = (_logits(peft_model, family, hf=True) - _logits(model, family)).abs().max().item()
    assert diff <= TOL
    # and the merged model agrees too
    merge_lora(model)
    assert (_logits(peft_model, family, hf=True) - _logits(model, family)).abs().max().item() <= TOL


def test_round_trip_through_peft_format(tmp_path: Path) -> None:
    model = apply_lora(native_model("llama3"), ["q", "v", "down"], rank=4, alpha=8, layers=[0])
    _randomize(model, seed=3)
    save_adapter(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    again = load_adapter(native_model("llama3"), tmp_path)
    assert torch.equal(_logits(again, "llama3"), _logits(model, "llama3"))


def test_generate_with_adapter_uses_it(tmp_path: Path) -> None:
    """``generate --adapter`` continues the prompt as PEFT's model with that adapter does
    (greedy, transformers' ``generate``), and not as the base model does."""
    from ckptkit.train.tokenizer import load_tokenizer

    peft_model = _peft_saved("llama2", tmp_path / "adapter", r=4, lora_alpha=64, target_modules=HF_ALL)
    text = generate_text(str(hf_dir("llama2")), "The quick", max_new_tokens=8, adapter=str(tmp_path / "adapter"))
    tok = load_tokenizer(hf_dir("llama2"))
    ids = torch.tensor([tok.encode("The quick")])
    greedy = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        adapted = peft_model.generate(input_ids=ids, **greedy)[0].tolist()
        plain = hf_model("llama2").generate(input_ids=ids, **greedy)[0].tolist()
    assert adapted != plain  # the adapter changes the continuation
    assert text == tok.decode(adapted)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_adapters_are_one_line_errors(tmp_path: Path) -> None:
    def error(family: str, folder: Path) -> str:
        with pytest.raises(CkptkitError) as info:
            load_adapter(native_model(family), folder)
        assert "\n" not in str(info.value)
        return str(info.value)

    _peft_saved("llama3", tmp_path / "bias", r=4, target_modules=["q_proj"])
    _edit_config(tmp_path / "bias", bias="all")
    assert "bias" in error("llama3", tmp_path / "bias")

    _peft_saved("llama3", tmp_path / "save", r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert "modules_to_save" in error("llama3", tmp_path / "save")

    assert "not a PEFT adapter" in error("llama3", tmp_path / "nowhere")

    model = apply_lora(native_model("phi3"), ["q"], rank=2)
    with pytest.raises(CkptkitError, match="only some parts of the fused"):
        save_adapter(model, tmp_path / "phi3-q")


def test_phi3_fused_modules_adapted_whole_round_trip_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    model = apply_lora(native_model("phi3"), ["q", "k", "v", "o", "gate", "up", "down"], rank=4, alpha=8)
    prepare_for_peft(model)
    _randomize(model, seed=5)
    modules = lora_modules(model)
    assert modules["layers.0.attn.q_proj"].lora_a is modules["layers.0.attn.v_proj"].lora_a  # PEFT's one A
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    peft_model = PeftModel.from_pretrained(hf_model("phi3"), tmp_path).eval()
    assert (_logits(peft_model, "phi3", hf=True) - _logits(model, "phi3")).abs().max().item() <= TOL
    again = load_adapter(native_model("phi3"), tmp_path)
    assert torch.equal(_logits(again, "phi3"), _logits(model, "phi3"))


def test_lora_targets_checked_against_the_model() -> None:
    from train_helpers import fixture_config

    with pytest.raises(CkptkitError, match=r"lora.targets: phi3 stores q k v as one module \(qkv_proj\)"):
        check_targets(["q", "v"], fixture_config("phi3"))
    with pytest.raises(CkptkitError, match=r"lora.targets: phi3 stores gate up as one module \(gate_up_proj\)"):
        check_targets(["up"], fixture_config("phi3"))
    with pytest.raises(CkptkitError, match="lora.targets: qwen2 ties the output projection"):
        check_targets(["q", "output"], fixture_config("qwen2"))
    check_targets(["q", "k", "v", "gate", "up"], fixture_config("phi3"))
    check_targets(["q", "output"], fixture_config("llama3"))
