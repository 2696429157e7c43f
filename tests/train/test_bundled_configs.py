"""The bundled recipe configs: each validates against its recipe's schema and is listed by
``ckptkit ls``; the realistic configs of the newer families (they need a GPU and the real
weights) run here with their own settings on the tiny fixture of their model type."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.errors import CkptkitError
from ckptkit.train.checkpointer import Checkpointer
from ckptkit.train.config import load_config, parse_config
from ckptkit.train.loop import RECIPES as SCHEMAS
from ckptkit.train.recipes import RECIPES, recipe_entry

from conftest import FIXTURES
from train_helpers import ckptkit

CONFIGS = Path(__file__).resolve().parents[2] / "ckptkit" / "train" / "configs"

NEW = {  # config -> recipe
    "qwen3_8B_lora": "lora_finetune",
    "qwen3_30B_A3B_lora": "lora_finetune",
    "mixtral_8x7B_lora": "lora_finetune",
    "mixtral_8x7B_lora_distributed": "lora_finetune_distributed",
    "gemma2_9B_lora": "lora_finetune",
    "olmo2_7B_full": "full_finetune",
    "moonlight_16B_A3B_lora_distributed": "lora_finetune_distributed",
    "glm4_5_air_lora_distributed": "lora_finetune_distributed",
    "qwen3_5_35B_A3B_lora": "lora_finetune",
    "gpt_oss_20B_lora": "lora_finetune",
    "qwen3_5_27B_qlora": "lora_finetune",
}
ELSEWHERE = {"qwen3_5_27B_qlora"}  # QLoRA: on fixtures/hf/qwen3_5-nf4 in test_qlora.py
ON_THE_FIXTURE = [  # what a CPU test must change: device, dtype, paths, sizes
    "device=cpu",
    "dtype=fp32",
    "dataset.source=tiny_alpaca",
    "dataset.max_seq_len=128",
    "batch_size=2",
    "gradient_accumulation_steps=1",
    "max_steps_per_epoch=1",
    "quiet=true",
]


@pytest.mark.parametrize(("recipe", "name"), [(r, n) for r, names in RECIPES.items() for n in names])
def test_every_bundled_config_validates_against_its_recipe_schema(recipe: str, name: str) -> None:
    cfg = parse_config(load_config(name), SCHEMAS[recipe][0])
    assert cfg.epochs >= 1 and cfg.checkpointer.checkpoint_dir


def test_ls_lists_the_new_families_configs() -> None:
    result = CliRunner().invoke(app, ["ls"])
    assert result.exit_code == 0, result.output
    for name in NEW:
        assert name in result.output


@pytest.mark.parametrize("name", [n for n in NEW if n not in ELSEWHERE])
def test_realistic_config_runs_on_the_tiny_fixture_of_its_model_type(name: str, tmp_path: Path) -> None:
    recipe = NEW[name]
    cfg = parse_config(load_config(name), SCHEMAS[recipe][0])
    model_type = cfg.checkpointer.model_type
    assert cfg.device == "cuda" and cfg.dtype == "bf16" and cfg.enable_activation_checkpointing
    overrides = [*ON_THE_FIXTURE, f"checkpointer.checkpoint_dir={FIXTURES / 'hf' / str(model_type)}",
                 f"checkpointer.output_dir={tmp_path}"]  # fmt: skip
    recipe_entry(recipe)(load_config(name, overrides))  # the config's targets, schedule, aux loss...
    out = tmp_path / "epoch_0"
    assert (out / "config.json").is_file()
    if "lora" in recipe:
        assert (out / "adapter" / "adapter_model.safetensors").is_file()


TINY = [(r, n) for r, names in RECIPES.items() for n in names if n.startswith("tiny_")]


@pytest.mark.parametrize(("recipe", "name"), TINY)
def test_a_tiny_config_reads_the_fixture_from_any_directory(
    recipe: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(load_config(name), SCHEMAS[recipe][0])
    assert Path(cfg.checkpointer.checkpoint_dir) == FIXTURES / "hf" / "llama2"
    assert cfg.dataset.source == "tiny_alpaca"  # a bundled dataset's name stays a name
    assert cfg.checkpointer.output_dir is not None and not Path(cfg.checkpointer.output_dir).is_absolute()
    with Checkpointer(cfg.checkpointer).open_base() as base:
        assert base.path == FIXTURES / "hf" / "llama2" and base.family.name == "llama2"


def test_an_override_path_is_the_users_relative_to_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny_lora", ["checkpointer.checkpoint_dir=fixtures/hf/llama2"])
    assert cfg["checkpointer"]["checkpoint_dir"] == "fixtures/hf/llama2"


def test_a_missing_path_is_named_by_its_config_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    proc = ckptkit("run", "lora_finetune", "--config", "tiny_lora", "checkpointer.checkpoint_dir=gone")
    assert proc.exit_code == 1
    assert proc.stderr.splitlines() == [
        f"error: {CONFIGS / 'tiny_lora.yaml'} with the KEY=VALUE overrides: config key checkpointer.checkpoint_dir: "
        "gone: no such file or directory"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_tokenizer_is_named_by_its_config_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CkptkitError, match="^config key tokenizer: gone: no such file or directory$"):
        recipe_entry("lora_finetune")(load_config("tiny_lora", ["tokenizer=gone", "quiet=true"]))


def test_a_tiny_recipe_runs_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    proc = ckptkit("run", "lora_finetune", "--config", "tiny_lora", "epochs=1", "max_steps_per_epoch=1", "quiet=true")
    assert proc.exit_code == 0, proc.output
    assert (tmp_path / "out" / "tiny_lora" / "epoch_0" / "adapter").is_dir()  # outputs in the cwd
