"""Recipe configs: every error class is one line, exit 1, nothing written; torchtune spellings work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config, parse_config
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.schema import FullFinetuneConfig, LoRAFinetuneConfig

from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]


def _fails(recipe: str, config: str, *overrides: str, tmp_path: Path) -> str:
    """Run through the CLI; assert exit 1, one stderr line, nothing written; return the line."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", recipe, "--config", config, *overrides, f"checkpointer.output_dir={out}"])
    message = result.stderr.strip()
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert not out.exists()
    return message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # unknown keys, with the nearest valid key suggested
        ("optimizer.lrr=1e-3", "unknown key optimizer.lrr; did you mean optimizer.lr?"),
        ("checkpointer.output_dirr=x", "unknown key checkpointer.output_dirr; did you mean checkpointer.output_dir?"),
        ("lora.rnk=4", "unknown key lora.rnk; did you mean lora.rank?"),
        # wrong types
        ("epochs=abc", "config key epochs: input should be a valid integer (got 'abc')"),
        ("epochs=1.5", "config key epochs: input should be a valid integer (got 1.5)"),
        ("optimizer.lr=", "config key optimizer.lr: input should be a valid number"),
        ("optimizer=adam", "config key optimizer: must be a section of keys"),
        ("max_steps_per_epoch=abc", "config key max_steps_per_epoch: input should be a valid integer"),
        ("lora.targets=[q,qkv]", "config key lora.targets[1]: input should be 'q', 'k'"),
        ("device=gpu", "config key device: input should be 'cpu', 'cuda' or 'auto'"),
        # bad ranges
        ("batch_size=0", "config key batch_size: input should be greater than or equal to 1 (got 0)"),
        ("batch_size=-1", "config key batch_size: input should be greater than or equal to 1 (got -1)"),
        ("epochs=0", "config key epochs: input should be greater than or equal to 1 (got 0)"),
        ("optimizer.lr=nan", "config key optimizer.lr: input should be greater than 0"),
        ("lora.dropout=1", "config key lora.dropout: input should be less than 1"),
        ("optimizer.betas=[0.9]", "config key optimizer.betas: too few values"),
        # overrides that are not YAML
        ("seed=[1", "override 'seed=[1': the value is not valid YAML"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(override: str, expected: str, tmp_path: Path) -> None:
    assert expected in _fails("lora_finetune", "tiny_lora", override, tmp_path=tmp_path)


def test_yaml_typo_and_wrong_recipe_are_refused(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "ckptkit/train/configs/tiny_full.yaml").read_text())
    cfg["epoch"] = cfg.pop("epochs")
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(cfg))
    assert "unknown key epoch; did you mean epochs?" in _fails("full_finetune", str(typo), tmp_path=tmp_path)
    # a full-fine-tuning config under the LoRA recipe (and back) would run with defaults: refused
    assert "no lora section: it is a full_finetune config" in _fails("lora_finetune", "tiny_full", tmp_path=tmp_path)
    assert "has a lora section: it is a lora_finetune config" in _fails("full_finetune", "tiny_lora", tmp_path=tmp_path)
    # a missing absolute data file is one line too (was NotImplementedError from a glob)
    message = _fails("full_finetune", "tiny_full", "dataset.source=/nowhere/data.json", tmp_path=tmp_path)
    assert "config key dataset.source: /nowhere/data.json: no such file" in message


def test_too_short_max_seq_len_is_refused_before_training(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(CkptkitError, match=r"dataset.max_seq_len=4 leaves no sample a token to train on"):
        cfg = load_config("tiny_lora", ["dataset.max_seq_len=4", f"checkpointer.output_dir={out}"])
        recipe_entry("lora_finetune")(cfg)  # was: NaN losses
    assert not out.exists()


@pytest.mark.slow
def test_a_process_error_has_no_traceback(tmp_path: Path) -> None:
    res = ckptkit("run", "full_finetune", "--config", "tiny_full", "optimizer.lrr=1e-3",
                  f"checkpointer.output_dir={tmp_path / 'o'}")  # fmt: skip
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("error: ") and "tiny_full.yaml" in line
    assert line.endswith("unknown key optimizer.lrr; did you mean optimizer.lr?")
    assert not (tmp_path / "o").exists()


def test_torchtune_spellings_mean_the_same(tmp_path: Path) -> None:
    ours = parse_config(load_config("tiny_lora"), LoRAFinetuneConfig)
    text = (REPO / "ckptkit/train/configs/tiny_lora.yaml").read_text()
    cfg = yaml.safe_load(text)
    cfg["output_dir"] = cfg["checkpointer"].pop("output_dir")
    cfg["checkpointer"]["output_dir"] = "${output_dir}"
    cfg["checkpointer"]["_component_"] = "torchtune.training.FullModelHFCheckpointer"
    cfg["checkpointer"]["model_type"] = "LLAMA2"
    cfg["optimizer"]["_component_"] = "torch.optim.AdamW"
    cfg["lr_scheduler"] = {
        "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "num_warmup_steps": 2,
        "min_lr_ratio": 0.1,
    }
    cfg["tokenizer"] = {"_component_": "torchtune.models.llama2.llama2_tokenizer", "path": "fixtures/hf/llama2"}
    cfg["dataset"]["_component_"] = "torchtune.datasets.alpaca_dataset"
    cfg["save_adapter_weights_only"] = True
    path = tmp_path / "tt.yaml"
    path.write_text(yaml.safe_dump(cfg))
    theirs = parse_config(load_config(str(path)), LoRAFinetuneConfig)
    assert theirs.checkpointer.output_dir == ours.checkpointer.output_dir == "out/tiny_lora"
    assert theirs.lr_scheduler == ours.lr_scheduler
    assert theirs.checkpointer.model_type == "llama2" and theirs.tokenizer == "fixtures/hf/llama2"
    assert theirs.checkpointer.torchtune_checkpointer == "torchtune.training.FullModelHFCheckpointer"
    assert theirs.lora.save_merged == "never"
    rest = {"checkpointer", "tokenizer", "lora"}
    assert theirs.model_dump(exclude=rest) == ours.model_dump(exclude=rest)
    with pytest.raises(CkptkitError, match=r"optimizer: _component_ 'torch.optim.SGD' is not a ckptkit component"):
        parse_config(load_config(str(path), ["optimizer._component_=torch.optim.SGD"]), LoRAFinetuneConfig)
    with pytest.raises(CkptkitError, match=r"output_dir \(a\) and checkpointer.output_dir \(b\) differ"):
        parse_config(load_config("tiny_full", ["output_dir=a", "checkpointer.output_dir=b"]), FullFinetuneConfig)
    with pytest.raises(CkptkitError, match=r"\$\{nope\} refers to a key the config does not have"):
        load_config("tiny_full", ["checkpointer.output_dir=${nope}/x"])


def test_torchtune_checkpointer_must_match_the_format(tmp_path: Path) -> None:
    meta = "checkpointer._component_=torchtune.training.FullModelMetaCheckpointer"
    message = _fails("full_finetune", "tiny_full", meta, tmp_path=tmp_path)
    assert "is a hf checkpoint but checkpointer._component_ names torchtune's checkpointer for meta" in message


def test_lora_targets_the_model_cannot_take_fail_in_setup(tmp_path: Path) -> None:
    fused = _fails("lora_finetune", "tiny_lora", "checkpointer.checkpoint_dir=fixtures/hf/phi3", "lora.targets=[q,v]",
                   tmp_path=tmp_path)  # fmt: skip
    assert fused.endswith("lora.targets: phi3 stores q k v as one module (qkv_proj) and PEFT adapts it whole: "
                          "list all of q k v or none of them")  # fmt: skip
    tied = _fails("lora_finetune", "tiny_lora", "checkpointer.checkpoint_dir=fixtures/hf/qwen2", tmp_path=tmp_path)
    assert "lora.targets: qwen2 ties the output projection to the embeddings" in tied
