"""A training run never writes into a folder that holds another run: it refuses in one line
(rank 0 looks, every rank stops before anything is written), and a resumed run appends to
``metrics.jsonl``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import tree_hashes
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]
COMMON = ["epochs=2", "max_steps_per_epoch=1", "quiet=true"]


def train(out: Path, *overrides: str) -> None:
    recipe_entry("full_finetune")(load_config("tiny_full", [*COMMON, f"checkpointer.output_dir={out}", *overrides]))


def test_a_second_run_into_a_run_s_folder_is_refused_and_a_resumed_one_appends(tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(out)
    before = tree_hashes(out)
    with pytest.raises(CkptkitError) as finished:
        train(out)
    assert str(finished.value) == (
        f"checkpointer.output_dir {out} holds a finished run (epoch_0, epoch_1, metrics.jsonl); "
        "choose another checkpointer.output_dir"
    )
    assert tree_hashes(out) == before  # nothing written, the metrics kept

    shutil.rmtree(out / "epoch_1")  # as a run stopped after epoch_0
    with pytest.raises(CkptkitError) as stopped:
        train(out)
    resume = f"resume_from_checkpoint=true checkpointer.recipe_checkpoint={out / 'epoch_0'}"
    assert str(stopped.value).endswith(f"(epoch_0, metrics.jsonl); resume it with {resume}, or choose another "
                                       "checkpointer.output_dir")  # fmt: skip
    old = (out / "metrics.jsonl").read_bytes()
    train(out, *resume.split())  # the hint, as given
    new = (out / "metrics.jsonl").read_bytes()
    assert new.startswith(old) and len(new) > len(old)  # appended to, not truncated
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "epoch_1", "metrics.jsonl"]

    shutil.rmtree(out / "epoch_0")
    shutil.rmtree(out / "epoch_1")  # a run stopped before its first checkpoint
    with pytest.raises(CkptkitError, match=r"holds another run \(metrics.jsonl\); choose another .* or delete it"):
        train(out)


def test_resuming_another_folder_s_checkpoint_into_a_run_s_folder_is_refused(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(a)
    train(b, "seed=7")
    before = tree_hashes(b)
    resume = ["resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={a / 'epoch_0'}"]
    with pytest.raises(CkptkitError, match=rf"output_dir {b} holds a finished run \(epoch_0, epoch_1, metrics.jsonl\)"):
        train(b, *resume)
    assert tree_hashes(b) == before  # b's run neither overwritten nor its metrics mixed
    train(c, *resume)  # into a folder of its own
    assert sorted(p.name for p in c.iterdir()) == ["epoch_1", "metrics.jsonl"]


def test_an_empty_or_unrelated_folder_is_fine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    train(out, "epochs=1")
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "metrics.jsonl", "notes.txt"]


def test_two_processes_refuse_a_run_s_folder_in_one_line_before_writing(tmp_path: Path) -> None:
    """``ckptkit run --nproc-per-node 2``: the launcher finds the other run and says so in one
    line before any process starts (exit 1), and the folder is as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = tree_hashes(out)
    proc = ckptkit("run", "full_finetune_distributed", "--nproc-per-node", "2", "--config", "tiny_full_distributed",
                   *COMMON, f"checkpointer.output_dir={out}")  # fmt: skip
    assert proc.exit_code == 1, proc.output
    said = f"checkpointer.output_dir {out} holds another run (metrics.jsonl)"
    assert proc.stderr.startswith(f"error: {said}; ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert tree_hashes(out) == before
