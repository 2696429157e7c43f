"""Fine-tuning the newer families (qwen3, qwen3_moe, mixtral, gemma2, gemma3_text, olmo2) on
CPU: full and LoRA runs write the input's layout (stacked experts stay stacked), adapters load
in PEFT on the transformers model with the native model's logits, merged outputs equal PEFT's
merge; for mixture-of-experts models LoRA adapts attention by default, experts and router
when asked, and the router's load-balancing loss is transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import FIXTURES, raw_layout, tree_hashes
from train_helpers import TOL, hf_model, native_model

NEW = ["qwen3", "qwen3_moe", "qwen3_moe-stacked", "mixtral", "mixtral-stacked", "gemma2", "gemma3_text", "olmo2"]
NEW += ["glm4_moe", "deepseek_v3", "deepseek_v3-qproj", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-vl"]
SHORT = ["epochs=1", "max_steps_per_epoch=2", "batch_size=2", "quiet=true"]
ATTENTION = ["q", "k", "v", "o"]
TARGETS = {  # every linear the family has, and for MoE experts and router
    "qwen3_moe": [*ATTENTION, "gate", "up", "down", "experts", "router"],  # layer 1 is dense
    "mixtral": [*ATTENTION, "experts", "router"],
    "glm4_moe": [*ATTENTION, "gate", "up", "down", "experts", "router"],  # gate/up/down: dense and shared
    "deepseek_v3": ["q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down", "experts", "router"],
    "deepseek_v3-qproj": ["q", "kv_a", "kv_b", "o", "experts", "router"],
    "gpt_oss": [*ATTENTION, "experts", "router"],  # stacked experts, as PEFT's target_parameters adapt them
    # hybrids: gated full attention and Gated DeltaNet's projections (its conv1d is no linear)
    "qwen3_next": [*ATTENTION, "in_proj_qkvz", "in_proj_ba", "out_proj", "gate", "up", "down", "experts", "router"],
    "qwen3_5": [*ATTENTION, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "gate", "up", "down"],
    "qwen3_5_moe": [*ATTENTION, "in_proj_qkv", "in_proj_z", "out_proj", "gate", "up", "down", "experts", "router"],
    "qwen3_5-vl": ["q", "v", "in_proj_qkv", "in_proj_b", "out_proj", "gate", "up", "down"],
}


def run(recipe: str, config: str, *overrides: str) -> None:
    recipe_entry(recipe)(load_config(config, list(overrides)))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def layout(root: Path) -> dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    return {f: [(k, t.dtype, tuple(t.shape)) for k, t in tensors] for f, tensors in raw_layout(root).items()}


@pytest.fixture(scope="module")
def float32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture converted to float32 (merges compared without bf16 rounding), made on demand."""
    root = tmp_path_factory.mktemp("float32")

    class Bases(dict):
        def __missing__(self, name: str) -> Path:
            convert(FIXTURES / "hf" / name, root / name, ConvertOptions("hf", dtype="float32"))
            self[name] = root / name
            return root / name

    return Bases()


@pytest.mark.parametrize("name", [n for n in NEW if n != "deepseek_v3-qproj"])  # its q_proj: LoRA below
def test_full_fine_tuning_writes_the_input_layout(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = FIXTURES / "hf" / name
    run(
        "full_finetune",
        "tiny_full",
        *SHORT,
        f"checkpointer.checkpoint_dir={src}",
        f"checkpointer.output_dir={tmp_path}",
    )
    losses = [m["loss"] for m in metrics(tmp_path) if "loss" in m]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    out = tmp_path / "epoch_0"
    assert layout(out) == layout(src)  # files, names in order (stacked or per expert), dtypes, shapes
    before = {k: t for f in raw_layout(src).values() for k, t in f}
    after = {k: t for f in raw_layout(out).values() for k, t in f}
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    carried = [k for k in before if k.startswith(("mtp.", "model.visual."))]  # hybrids' MTP layers, vision tower
    assert bool(carried) == name.startswith(("qwen3_next", "qwen3_5"))
    assert all(torch.equal(before[k], after[k]) for k in carried)  # loaded, never trained, written as read
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert loaded.state_dict().keys() == reference.state_dict().keys()


def _logits(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hf else model(ids)


@pytest.mark.parametrize("name", NEW)
def test_lora_adapter_loads_in_peft_and_merged_output_equals_peft_merge(
    name: str, float32: dict[str, Path], tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ckptkit.train.peft_io import load_adapter
    from ckptkit.train.transformer import load_model

    # a multimodal release's adapter names its text model as the release does (model.language_model.)
    auto = AutoModelForImageTextToText if name.endswith("-vl") else AutoModelForCausalLM
    family = name.removesuffix("-stacked")
    targets = TARGETS.get(name, TARGETS.get(family, [*ATTENTION, "gate", "up", "down"]))
    base = float32[name]
    run("lora_finetune", "tiny_lora", *SHORT, f"lora.targets=[{','.join(targets)}]",
        f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={tmp_path}")  # fmt: skip
    out = tmp_path / "epoch_0"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    moe = "experts" in targets
    assert bool(config["target_parameters"]) == moe  # stacked experts and router: PEFT's target_parameters

    ids = torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(5))
    peft = PeftModel.from_pretrained(auto.from_pretrained(base, dtype=torch.float32), out / "adapter")
    ours = load_adapter(load_model(str(base), dtype=torch.float32), out / "adapter")
    want = _logits(peft.eval(), ids, hf=True)
    assert (_logits(ours, ids, hf=False) - want).abs().max().item() <= TOL
    assert (want - _logits(load_model(str(base), dtype=torch.float32), ids, hf=False)).abs().max().item() > 1e-3

    assert layout(out) == layout(base)  # the merged model in the input's layout
    merged = auto.from_pretrained(out, dtype=torch.float32).eval()
    theirs = peft.merge_and_unload().state_dict()
    worst = {k: (v - theirs[k]).abs().max().item() for k, v in merged.state_dict().items()}
    assert max(worst.values()) < 1e-6, worst  # float32 rounding of W + s * B @ A
    if moe:  # the experts' deltas are in the merged weights (not dropped on the way out)
        stacked = next(k for k in merged.state_dict() if k.endswith("mlp.experts.down_proj"))
        start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()[stacked]
        assert not torch.equal(merged.state_dict()[stacked], start)
        # `ckptkit merge` of the adapter writes the recipe's merged model byte for byte
        result = CliRunner().invoke(app, ["merge", str(base), str(out / "adapter"), str(tmp_path / "merged")])
        assert result.exit_code == 0, result.output
        recipe = {k: v for k, v in tree_hashes(out).items() if "adapter" not in k}
        assert tree_hashes(tmp_path / "merged") == recipe
    assert (_logits(merged, ids, hf=True) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_next"])
def test_peft_expert_and_router_adapters_load_in_ckptkit(family: str, tmp_path: Path) -> None:
    # PEFT's own adapters: one stacked tensor, both nested, the router; ckptkit's logits equal.
    # qwen3_next: also its linear attention's fused projections and out_proj.
    modules = ["k_proj", *(["in_proj_qkvz", "in_proj_ba", "out_proj"] if family == "qwen3_next" else [])]
    from peft import LoraConfig, get_peft_model

    from ckptkit.train.peft_io import load_adapter

    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(2))
    for i, params in enumerate(
        (["mlp.experts.down_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"])
    ):
        torch.manual_seed(i)
        peft = get_peft_model(
            hf_model(family), LoraConfig(r=2, lora_alpha=6, target_modules=modules, target_parameters=params)
        )
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
        peft.save_pretrained(tmp_path / str(i))
        ours = load_adapter(native_model(family), tmp_path / str(i))
        assert (_logits(ours, ids, hf=False) - _logits(peft.eval(), ids, hf=True)).abs().max().item() <= TOL


def test_lora_on_a_moe_model_adapts_attention_by_default() -> None:
    from ckptkit.train.lora import apply_lora, lora_modules
    from ckptkit.train.schema import LoRAConfig

    cfg = LoRAConfig()
    model = native_model("mixtral")
    apply_lora(model, targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)
    names = list(lora_modules(model))
    assert names and all(".attn." in n for n in names)


def test_moe_lora_targets_are_checked_before_training(tmp_path: Path) -> None:
    from ckptkit.train.lora_targets import check_targets

    from train_helpers import fixture_config

    with pytest.raises(CkptkitError, match="lora.targets: qwen3 has no experts; remove experts and router"):
        check_targets(["q", "experts", "router"], fixture_config("qwen3"))
    with pytest.raises(CkptkitError, match="every mixtral layer has experts instead: use experts"):
        check_targets(["q", "gate"], fixture_config("mixtral"))
    with pytest.raises(CkptkitError, match="lora.dropout: PEFT adapts experts as stacked tensors, without dropout"):
        check_targets(["experts"], fixture_config("qwen3_moe"), dropout=0.1)
    check_targets(["gate", "experts"], fixture_config("qwen3_moe"))  # its layer 1 is dense
    with pytest.raises(CkptkitError, match="every gpt_oss layer has stacked experts instead: use experts"):
        check_targets(["q", "gate"], fixture_config("gpt_oss"))
    check_targets(["q", "experts", "router"], fixture_config("gpt_oss"))
    with pytest.raises(CkptkitError, match="PEFT adapts gpt_oss's router as parameters, without dropout"):
        check_targets(["router"], fixture_config("gpt_oss"), dropout=0.1)
    with pytest.raises(CkptkitError, match="PEFT adapts gpt_oss's experts as parameters, without dropout"):
        check_targets(["q", "experts"], fixture_config("gpt_oss"), dropout=0.1)
    gpt_oss = f"checkpointer.checkpoint_dir={FIXTURES / 'hf' / 'gpt_oss'}"
    with pytest.raises(CkptkitError, match="load-balancing loss of gpt_oss's router is not supported yet"):
        run(
            "full_finetune",
            "tiny_full",
            *SHORT,
            gpt_oss,
            "router_aux_loss_coef=0.01",
            f"checkpointer.output_dir={tmp_path}",
        )
    with pytest.raises(CkptkitError, match="router_aux_loss_coef applies to mixture-of-experts models"):
        run("full_finetune", "tiny_full", *SHORT, "router_aux_loss_coef=0.01", f"checkpointer.output_dir={tmp_path}")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
