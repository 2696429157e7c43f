"""One training loop for every recipe: each config key has its effect, the same one, on one
device and on 2 FSDP2 processes (gloo, CPU), for full and LoRA fine-tuning.

Both paths run under ``tests/probe_recipe.py``, which records from the loop's own objects what
each key did: the blocks compiled, the optimizer's param groups, the samples held out for
validation, every step's learning rate, global batches and each rank's part of them, and the
gradient norm clipping saw. The 2-process runs take ``batch_size`` per rank, so 2 x 2 is the
single-device 4. Losses, validation losses and gradient norms agree to 1e-5 relative (float
sums added in another order, see test_distributed.py); everything else is equal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.train.config import load_config, parse_config
from ckptkit.train.data import build_datasets, epoch_batches
from ckptkit.train.loop import RECIPES
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
# Every key the distributed recipes once ignored or implemented apart, at a value that is not its
# default (on a CPU the optimizer is fused by default, so false is the value that shows).
KEYS = [
    "seed=7", "dataset.validation_fraction=0.25", "eval_every_n_steps=2", "compile=true", "optimizer.fused=false",
    "optimizer.weight_decay=0.1", "optimizer.betas=[0.8,0.95]", "gradient_accumulation_steps=2", "clip_grad_norm=0.5",
    "lr_scheduler.warmup_steps=2", "lr_scheduler.min_lr_ratio=0.2", "epochs=2", "max_steps_per_epoch=3",
    "save_every_n_steps=2", "log_every_n_steps=2", "quiet=true",
]  # fmt: skip
NO_DYNAMO = {"TORCH_COMPILE_DISABLE": "1"}  # compile wraps each block; running it compiled is tested below


def rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun(recipe: str, config: str, *overrides: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", f"ckptkit.train.recipes.{recipe}", "--config", config, *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]


def probe_here(recipe: str, config: str, *overrides: str) -> None:
    """Run ``recipe`` in this process under tests/probe_recipe.py's probes, dynamo disabled as
    ``TORCH_COMPILE_DISABLE=1`` disables it."""
    import torch._dynamo
    from probe_recipe import probing

    with probing(), torch._dynamo.config.patch(disable=True):
        recipe_entry(recipe)(load_config(config, list(overrides)))


def probe(launch: list[str], recipe: str, config: str, *overrides: str) -> str:
    """Run ``recipe`` under tests/probe_recipe.py (``launch``: python, or torchrun); its stderr."""
    cmd = [*launch, "tests/probe_recipe.py", recipe, "--config", config, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **NO_DYNAMO})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= RTOL * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def held_out(recipe: str, config: str, seed: int) -> list[list[int]]:
    """The validation samples (token ids) the data builder holds out of the config's dataset with ``seed``."""
    cfg = parse_config(load_config(config, ["dataset.validation_fraction=0.25"]), RECIPES[recipe][0])
    folder = Path(cfg.checkpointer.checkpoint_dir)
    val = build_datasets(cfg.dataset, load_tokenizer(folder), folder, seed)[1]
    assert val is not None
    return [s.ids for s in val.samples]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "config"), [("full_finetune", "tiny_full"), ("lora_finetune", "tiny_lora")])
def test_config_keys_have_the_same_effect_on_one_device_and_two_processes(
    recipe: str, config: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    single, dist = tmp_path / "single", tmp_path / "dist"
    torchrun_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    probe_here(recipe, config, *KEYS, "batch_size=4", f"checkpointer.output_dir={single}")  # one device, here
    captured = capsys.readouterr()
    logs = [
        captured.out + captured.err,
        probe(
            torchrun_2,
            f"{recipe}_distributed",
            f"{config}_distributed",
            *KEYS,
            "batch_size=2",
            f"checkpointer.output_dir={dist}",
        ),  # fmt: skip
    ]
    one = json.loads((single / "probe_rank_0.json").read_text())
    ranks = [json.loads((dist / f"probe_rank_{r}.json").read_text()) for r in (0, 1)]
    lr = parse_config(load_config(config), RECIPES[recipe][0]).optimizer.lr

    for run in (one, *ranks):
        assert run["compiled"] == [True, True]  # compile: each of the 2 blocks is a compiled module
        # optimizer.*: the optimizer's own param groups, fused off (the CPU default is on)
        assert [(g["initial_lr"], g["betas"], g["weight_decay"], g["fused"]) for g in run["param_groups"]] == [
            (lr, [0.8, 0.95], 0.1, False)
        ]
        # dataset.validation_fraction with seed 7: the same 12 of the 48 samples held out
        assert run["validation"] == held_out(recipe, config, 7) != held_out(recipe, config, 0)
        assert len(run["validation"]) == 12 and len(run["training"]) == 36
        # 36 training rows / (global batch 4 x gradient_accumulation_steps 2) = 4 steps, cut to 3, 2 epochs
        steps = run["steps"]
        assert len(steps) == 6 and all([len(b) for b in s["batches"]] == [4, 4] for s in steps)
        for epoch in (0, 1):  # the global batches, in the order seed 7 draws (seed 0 draws another)
            order = [b for s in steps[3 * epoch : 3 * epoch + 3] for b in s["batches"]]
            assert order == epoch_batches(36, 4, 7, epoch)[:6] != epoch_batches(36, 4, 0, epoch)[:6]
        # clip_grad_norm: clipping to 0.5 saw norms above it
        assert all(s["clip"][1] == 0.5 for s in steps) and min(s["clip"][0] for s in steps) > 0.5
        # lr_scheduler: 2 warmup steps up to lr, then cosine down; min_lr_ratio is checked below
        lrs = [s["lr"] for s in steps]
        assert lrs[:3] == pytest.approx([lr / 3, 2 * lr / 3, lr]) and lrs[2:] == sorted(lrs[2:], reverse=True)
        assert lrs[-1] > 0.2 * lr
    for r, rank in enumerate(ranks):  # the same steps, each rank taking its strided part of every global batch
        assert [s["batches"] for s in rank["steps"]] == [s["batches"] for s in one["steps"]]
        assert [s["mine"] for s in rank["steps"]] == [[b[r::2] for b in s["batches"]] for s in one["steps"]]
        assert [s["lr"] for s in rank["steps"]] == [s["lr"] for s in one["steps"]]
        assert_close([s["clip"][0] for s in rank["steps"]], [s["clip"][0] for s in one["steps"]])

    a, b = rows(single), rows(dist)
    # log_every_n_steps: steps 2, 4 and 6 only; the losses agree (seed, accumulation, clipping)
    train_a, train_b = ([r for r in rs if "loss" in r] for rs in (a, b))
    assert [r["step"] for r in train_a] == [r["step"] for r in train_b] == [2, 4, 6]
    assert_close([r["loss"] for r in train_a], [r["loss"] for r in train_b])
    assert [r["lr"] for r in train_a] == [r["lr"] for r in train_b]
    assert train_a[-1]["lr"] == pytest.approx(0.2 * lr)  # min_lr_ratio: where the schedule ends
    # eval_every_n_steps: every 2 steps, and at the end of epoch 0 (step 3), which none of them reached
    evals_a, evals_b = ([(r["step"], r["eval_loss"]) for r in rs if "eval_loss" in r] for rs in (a, b))
    assert [s for s, _ in evals_a] == [s for s, _ in evals_b] == [2, 3, 4, 6]
    assert_close([v for _, v in evals_a], [v for _, v in evals_b])  # the same validation split
    # save_every_n_steps: step_N between epoch ends
    names = [[Path(r["checkpoint"]).name for r in rs if "checkpoint" in r] for rs in (a, b)]
    assert names[0] == names[1] == ["step_2", "epoch_0", "step_4", "epoch_1"]
    # quiet: no progress line on either path
    assert [line for log in logs for line in log.splitlines() if re.search(r"step \d+/\d+|saved ", line)] == []


@pytest.mark.slow
def test_compiled_blocks_train_under_fsdp2(tmp_path: Path) -> None:
    """``compile: true`` on 2 processes runs the compiled blocks (no TORCH_COMPILE_DISABLE) and
    gives the eager single-device loss."""
    common = ["epochs=1", "max_steps_per_epoch=1", "quiet=true"]
    recipe_entry("full_finetune")(load_config("tiny_full", [*common, f"checkpointer.output_dir={tmp_path / 'eager'}"]))
    torchrun("full_finetune_distributed", "tiny_full_distributed", *common, "compile=true",
             f"checkpointer.output_dir={tmp_path / 'compiled'}")  # fmt: skip
    eager, compiled = rows(tmp_path / "eager"), rows(tmp_path / "compiled")
    assert compiled[0]["setup"]["compiled_layers"] == 2 and eager[0]["setup"]["compiled_layers"] == 0
    assert_close([r["loss"] for r in eager if "loss" in r], [r["loss"] for r in compiled if "loss" in r])


def test_an_epoch_end_between_evaluations_evaluates(tmp_path: Path) -> None:
    """eval_every_n_steps=2 with 3 steps per epoch, in process: validation loss at steps 2 and 4
    and at each epoch's end (3, and 6, which is also due: logged once)."""
    out = tmp_path / "out"
    overrides = ["epochs=2", "max_steps_per_epoch=3", "eval_every_n_steps=2", "dataset.validation_fraction=0.25",
                 "lora.save_merged=never", "quiet=true", f"checkpointer.output_dir={out}"]  # fmt: skip
    recipe_entry("lora_finetune")(load_config("tiny_lora", overrides))
    evals = [(r["step"], r["epoch"], r["eval_loss"]) for r in rows(out) if "eval_loss" in r]
    assert [(step, epoch) for step, epoch, _ in evals] == [(2, 0), (3, 0), (4, 1), (6, 1)]
    assert len({loss for *_, loss in evals}) == 4  # each after another step
