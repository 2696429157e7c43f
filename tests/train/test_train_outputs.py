"""What training leaves behind and says: checkpoint folders, adapters PEFT loads from a Meta
base, log lines when not on a terminal, the end summary, W&B."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.train.checkpointer import checkpoint_name
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import FIXTURES, tree_hashes
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]


def run(recipe: str, config: str, *overrides: str) -> None:
    recipe_entry(recipe)(load_config(config, list(overrides)))


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_checkpoint_names_sort_in_training_order() -> None:
    names = [checkpoint_name("epoch", n, 10) for n in range(11)]
    assert names[:3] == ["epoch_00", "epoch_01", "epoch_02"] and sorted(names) == names
    assert checkpoint_name("step", 5, 12) == "step_05" and checkpoint_name("epoch", 3, 3) == "epoch_3"


def test_lora_checkpoints_adapter_only_until_the_end_keep_last_n(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=1",
        "checkpointer.keep_last_n_checkpoints=2", f"checkpointer.output_dir={out}")  # fmt: skip
    kept = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert kept == ["epoch_0", "step_3"]  # the newest two by step, of step_1, step_2, step_3, epoch_0
    intermediate = files(out / "step_3")
    assert intermediate == {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "recipe_state/recipe_state.pt"
    }  # fmt: skip
    final = files(out / "epoch_0")
    assert "model.safetensors.index.json" in final and "adapter/adapter_model.safetensors" in final
    assert not any(name.startswith("recipe_state") for name in final)

    # the final checkpoint can be adapter-only too, and intermediate ones merged
    run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=1", "lora.save_merged=never",
        f"checkpointer.output_dir={tmp_path / 'never'}")  # fmt: skip
    assert files(tmp_path / "never" / "epoch_0") == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    # ... and `ckptkit merge` makes the merged model of any adapter checkpoint later, byte for byte the recipe's
    one = ["epochs=1", "max_steps_per_epoch=1"]
    run("lora_finetune", "tiny_lora", *one, f"checkpointer.output_dir={tmp_path / 'final'}")
    result = CliRunner().invoke(
        app, ["merge", "fixtures/hf/llama2", str(tmp_path / "never" / "epoch_0" / "adapter"), str(tmp_path / "merged")]
    )
    assert result.exit_code == 0, result.output
    recipe_merged = {k: v for k, v in tree_hashes(tmp_path / "final" / "epoch_0").items() if "adapter" not in k}
    assert tree_hashes(tmp_path / "merged") == recipe_merged
    run("lora_finetune", "tiny_lora", "epochs=2", "max_steps_per_epoch=1", "lora.save_merged=every",
        f"checkpointer.output_dir={tmp_path / 'every'}")  # fmt: skip
    assert "model.safetensors.index.json" in files(tmp_path / "every" / "epoch_0")


def test_meta_base_adapter_names_an_hf_base_peft_loads(tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM

    from ckptkit.train.peft_io import load_adapter
    from ckptkit.train.transformer import load_model

    out = tmp_path / "out"
    src = FIXTURES / "meta" / "llama2"
    before = tree_hashes(src)
    run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=2", "lora.targets=[q,v,down]",
        f"checkpointer.checkpoint_dir={src}", f"checkpointer.output_dir={out}")  # fmt: skip
    config = json.loads((out / "epoch_0" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base_hf").resolve())
    peft = AutoPeftModelForCausalLM.from_pretrained(out / "epoch_0" / "adapter", dtype=torch.float32).eval()
    ours = load_adapter(load_model(src, dtype=torch.float32), out / "epoch_0" / "adapter").eval()
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (peft(ids).logits - ours(ids)).abs().max().item() < 1e-5
    assert tree_hashes(src) == before


def test_meta_intermediate_checkpoint_holds_one_model(tmp_path: Path) -> None:
    """llama.cpp's convert_legacy_llama.py takes every .pth of a folder: the recipe state is in a subfolder."""
    src = FIXTURES / "meta" / "llama2"
    run("full_finetune", "tiny_full", "epochs=2", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={src}",
        f"checkpointer.output_dir={tmp_path / 'a'}")  # fmt: skip
    top = {p.name for p in (tmp_path / "a" / "epoch_0").iterdir()}
    assert [n for n in top if n.endswith((".pth", ".pt"))] == ["consolidated.00.pth"] and "recipe_state" in top
    run("full_finetune", "tiny_full", "epochs=2", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={src}",
        "resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={tmp_path / 'a' / 'epoch_0'}",
        f"checkpointer.output_dir={tmp_path / 'b'}")  # fmt: skip
    assert tree_hashes(tmp_path / "a" / "epoch_1") == tree_hashes(tmp_path / "b" / "epoch_1")


LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step (\d+)/3 epoch 0 loss \d+\.\d{4} lr \d\.\d{3}e-\d\d tokens/s \d+ "
    r"peak_mem \d+\.\d (MiB|GiB)"
)


def test_plain_log_lines_and_summary_when_not_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = ckptkit("run", "lora_finetune", "--config", "tiny_lora", "epochs=1", "max_steps_per_epoch=3",
                  f"checkpointer.output_dir={out}")  # fmt: skip
    assert res.exit_code == 0, res.output[-3000:]
    lines = res.stderr.strip().splitlines()
    steps = [m.group(1) for m in map(LOG_LINE.fullmatch, lines) if m]
    assert steps == ["1", "2", "3"], lines
    assert "nan" not in res.stderr and " 0 tok/s" not in res.stderr
    assert lines[-2].endswith("finished at step 3/3 after " + lines[-2].split(" after ")[1])
    assert lines[-1].endswith(f"checkpoints: {out / 'epoch_0'}")


def test_interrupted_run_says_how_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from ckptkit.train.loop import Recipe

    real_step = Recipe._step
    calls = []

    def step_then_stop(self, batches):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(self, batches)

    monkeypatch.setattr(Recipe, "_step", step_then_stop)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=1", "quiet=false",
            f"checkpointer.output_dir={out}")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-3].endswith("stopped at step 2/4 after " + err[-3].split(" after ")[1])
    resume = f"resume_from_checkpoint=true checkpointer.recipe_checkpoint={out / 'step_2'}"
    assert err[-1].endswith(f"resume with the same command plus: {resume}")


def test_wandb_project_without_wandb_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's way of making an import fail
    res = ckptkit("run", "lora_finetune", "--config", "tiny_lora", "wandb.project=x", "epochs=1",
                  "max_steps_per_epoch=1", f"checkpointer.output_dir={tmp_path / 'o'}")  # fmt: skip
    assert res.exit_code == 1
    assert res.stderr.strip() == "error: wandb.project is set but wandb is not installed (pip install wandb)"


@pytest.mark.slow
def test_wandb_offline_run_records_the_metrics(tmp_path: Path) -> None:
    """wandb is in the test extra: this runs (offline, no network) wherever the tests do."""
    out = tmp_path / "out"
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [sys.executable, "-m", "ckptkit", "run", "lora_finetune", "--config", "tiny_lora", "epochs=1",
         "max_steps_per_epoch=2", "wandb.project=ckptkit-test", "wandb.mode=offline", f"checkpointer.output_dir={out}"],
        cwd=REPO, capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    (record,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        if "loss" in row:
            assert json.dumps(row["loss"]).encode() in data  # the value W&B will sync


def test_terminal_bar_shows_no_numbers_before_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from ckptkit.train.metrics import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    progress = Progress(total=4, done=0, quiet=False)

    def shown() -> str:
        console = Console(file=io.StringIO(), width=120, force_terminal=False)
        console.print(progress.bar.get_renderable())
        return console.file.getvalue()

    assert "0/4" in shown() and "nan" not in shown() and "tok/s" not in shown()  # was: loss nan 0 tok/s
    progress.update(1, 0, 2.5, 1e-3, 1234.0, 100)
    assert "loss 2.5000  1234 tok/s" in shown()


def test_a_start_summary_comes_first_and_epochs_are_numbered_as_the_folders(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from train_helpers import hf_model

    out = tmp_path / "out"
    res = ckptkit("run", "lora_finetune", "--config", "tiny_lora", "epochs=2", "max_steps_per_epoch=2",
                  "save_every_n_steps=1", f"checkpointer.output_dir={out}")  # fmt: skip
    assert res.exit_code == 0, res.output[-3000:]
    lines = [line[len("2026-01-01 00:00:00 ") :] for line in res.stderr.strip().splitlines()]
    # PEFT's count for tiny_lora's adapters (rank 16 on every projection and lm_head) on the same base
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    trainable, total = get_peft_model(
        hf_model("llama2"), LoraConfig(r=16, target_modules=targets)
    ).get_nb_trainable_parameters()
    share = trainable / total
    samples = len((REPO / "ckptkit" / "train" / "datasets" / "tiny_alpaca.jsonl").read_text().splitlines())
    assert lines[:3] == [
        f"model: llama2 from {REPO / 'fixtures/hf/llama2'}, {total:,} parameters, {trainable:,} trainable "
        f"({share:.2%})",
        f"data: {samples} training samples, 2 steps per epoch x 2 epochs (0 to 1) = 4 steps of 8 samples",
        f"output: {out}; cpu, fp32",
    ]
    assert lines[3].startswith("step 1/4 ")
    # each epoch_N folder is saved right after the last step the log counts in epoch N
    epoch = None
    saved = {}
    for line in lines:
        if m := re.match(r"step \d+/4 epoch (\d+) ", line):
            epoch = int(m.group(1))
        elif line.startswith("saved "):
            saved[Path(line.removeprefix("saved ")).name] = epoch
    assert saved == {"step_1": 0, "epoch_0": 0, "step_3": 1, "epoch_1": 1}
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = {r["step"]: r["epoch"] for r in rows if "loss" in r}
    assert {Path(r["checkpoint"]).name: epochs[r["step"]] for r in rows if "checkpoint" in r} == saved


# Paths in the bundled configs' comments: the output folder's are made by a run, the others are in the repository.
COMMENT_PATH = re.compile(r"(?<![\w./-])/?[\w.-]+(?:/[\w.-]+)+")
NOT_PATHS = {"JSON/JSONL"}


def comment_paths(config: Path) -> list[str]:
    found = []
    for line in config.read_text().splitlines():
        found += [p.rstrip(".") for p in COMMENT_PATH.findall(line.partition("#")[2])]  # not a full stop
    return [p for p in found if p not in NOT_PATHS and not p.startswith("/path/to/")]


def under_output(config: Path) -> tuple[str, list[str]]:
    """The config's output_dir and its comments' paths inside it, relative, ``*_N`` kept."""
    import yaml

    output = yaml.safe_load(config.read_text())["checkpointer"]["output_dir"]
    return output, [p.removeprefix(output + "/") for p in comment_paths(config) if p.startswith(output + "/")]


TINY = ["tiny_full", "tiny_lora", "tiny_full_distributed", "tiny_lora_distributed"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_every_path_in_a_tiny_configs_comments_exists_after_a_run(name: str, tmp_path: Path) -> None:
    from ckptkit.train.config import bundled_configs

    config = bundled_configs()[name]
    recipe = {"tiny_full": "full_finetune", "tiny_lora": "lora_finetune"}[name.removesuffix("_distributed")]
    out = tmp_path / "out"
    overrides = ["epochs=2", "max_steps_per_epoch=2", "quiet=true", f"checkpointer.output_dir={out}"]
    if name.endswith("_distributed"):
        proc = subprocess.run([sys.executable, "-m", "ckptkit", "run", "--nproc-per-node", "2", f"{recipe}_distributed",
                               "--config", name, *overrides], cwd=REPO, capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        run(recipe, name, *overrides)
    output, inside = under_output(config)
    assert inside, "a comment names where the recipe state is"
    for rel in inside:  # N: the first checkpoint of that kind (epoch_0 keeps its recipe state)
        kind = re.search(r"(epoch|step)_N", rel)
        first = min((p.name for p in out.glob(f"{kind.group(1)}_*")), default="none") if kind else ""
        path = out / (rel.replace(kind.group(0), first) if kind else rel)
        assert path.exists(), f"{config.name}: # {output}/{rel} -> {path} is missing"
    for path in comment_paths(config):
        if not path.startswith(output + "/"):
            assert (REPO / path).exists(), f"{config.name}: # {path} is missing"


def test_paths_in_the_large_configs_comments_are_those_a_tiny_run_makes() -> None:
    from ckptkit.train.config import bundled_configs

    def shapes(names: list[str]) -> set[str]:
        return {re.sub(r"(epoch|step)_N", "X_N", rel) for n in names for rel in under_output(bundled_configs()[n])[1]}

    for name, config in bundled_configs().items():
        if name in TINY:
            continue
        distributed = name.endswith("_distributed")
        made = shapes([t for t in TINY if t.endswith("_distributed") == distributed])
        assert shapes([name]) <= made, name
        for path in comment_paths(config):
            if not path.startswith(under_output(config)[0] + "/"):
                assert (REPO / path).exists(), f"{config.name}: # {path} is missing"


def test_a_quiet_stopped_run_still_says_how_to_resume(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``quiet=true`` silences progress, never the one line a stopped run's user needs."""
    from ckptkit.train.metrics import Progress

    class Saved:
        saved = [tmp_path / "step_001", tmp_path / "step_002"]

        def latest_resumable(self) -> Path:
            return self.saved[-1]

    Progress(total=40, done=0, quiet=True).summary(2, Saved(), finished=False)
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "resume with the same command plus: resume_from_checkpoint=true "
            f"checkpointer.recipe_checkpoint={tmp_path / 'step_002'}"
        )
    )
    Progress(total=40, done=0, quiet=True).summary(40, Saved(), finished=True)
    assert capsys.readouterr().err == ""  # a finished quiet run says nothing
