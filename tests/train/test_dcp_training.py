"""Sharded (DCP) checkpoints of the FSDP2 recipes, on CPU with gloo: every rank writes its own
shards, ``checkpointer.async_save`` overlaps the write with training, a kill before an
asynchronous save is published keeps the previous checkpoint, resuming is exact (bitwise at
the same number of ranks; on another number of ranks the float sums of 1 and 2 processes
differ, see test_distributed.py for tolerances), epoch outputs come out in the input's
format (Meta, 2 shards), converted from the shards, and a recipe state whose ``.metadata``
would run code is refused before torch's reader sees it.

One module-level run (Meta 2-shard fixture, 2 epochs of 2 steps, a checkpoint every step)
serves as the uninterrupted reference.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkit.checkpoint import open_checkpoint
from ckptkit.train.config import load_config
from ckptkit.train.distributed import sharded_model
from ckptkit.train.recipes import recipe_entry

from conftest import FIXTURES, raw_layout, tree_hashes
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]
BASE = FIXTURES / "meta" / "llama2-2rank"
COMMON = ["epochs=2", "max_steps_per_epoch=2", "save_every_n_steps=1", "quiet=true",
          f"checkpointer.checkpoint_dir={BASE}"]  # fmt: skip
RECIPE = ["-m", "ckptkit.train.recipes.full_finetune_distributed"]
LOSS_RTOL, WEIGHT_ATOL, ADAPTER_ATOL = (
    1e-5,
    1e-4,
    5e-4,
)  # 1 vs 2 processes: float sums in another order (test_distributed.py)


def torchrun(
    target: list[str], *args: str, nproc: int = 2, env: dict[str, str] | None = None, config: str = "tiny_full"
) -> int:
    common = COMMON if config == "tiny_full" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target,
           "--config", f"{config}_distributed", *common, *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if env is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


def rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in rows(output_dir) if "loss" in r]


def lrs(output_dir: Path) -> list[float]:
    return [r["lr"] for r in rows(output_dir) if "lr" in r]


def assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= LOSS_RTOL * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def model_files(folder: Path) -> dict[str, str]:
    """Hashes of a checkpoint's files but its DCP state (whose ``.metadata`` records a save id)."""
    return {k: v for k, v in tree_hashes(folder).items() if not k.startswith("recipe_state/")}


def resume(folder: Path) -> list[str]:
    return ["resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={folder}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, synchronous saves, uninterrupted: step_1, epoch_0, step_3, epoch_1 (final)."""
    out = tmp_path_factory.mktemp("dcp-train") / "reference"
    torchrun(RECIPE, f"checkpointer.output_dir={out}")
    return out


@pytest.mark.slow
def test_each_rank_writes_its_shards_and_epochs_come_out_in_the_input_format(reference: Path) -> None:
    assert [Path(r["checkpoint"]).name for r in rows(reference) if "checkpoint" in r] == [
        "step_1", "epoch_0", "step_3", "epoch_1"
    ]  # fmt: skip
    # a step checkpoint is the sharded state only: one file per rank, each rank's rows in its own file
    state = reference / "step_1" / "recipe_state"
    assert sorted(p.name for p in (reference / "step_1").iterdir()) == ["recipe_state"]
    assert sorted(p.name for p in state.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    reader = sharded_model(state)
    assert len(reader.entries) == 2 + 9 * 2 + 1  # embeddings, output, norm; 9 tensors per layer
    for name, entry in reader.entries.items():
        files = sorted(c.file for c in entry.chunks if c.numel)
        assert files == ["__0_0.distcp", "__1_0.distcp"], (name, files)  # FSDP2 Shard(0): half the rows each
    sizes = [(state / f).stat().st_size for f in ("__0_0.distcp", "__1_0.distcp")]
    assert abs(sizes[0] - sizes[1]) < 0.2 * sizes[1], sizes  # rank 0 holds no more than its share
    # epoch outputs: Meta in, Meta out (same files, names, dtypes, partition), converted from the shards
    base = raw_layout(BASE)
    for name in ("epoch_0", "epoch_1"):
        folder = reference / name
        out = raw_layout(folder)
        assert list(out) == list(base) == ["consolidated.00.pth", "consolidated.01.pth"]
        for file in base:
            assert [(k, t.dtype, t.shape) for k, t in out[file]] == [(k, t.dtype, t.shape) for k, t in base[file]]
    assert (reference / "epoch_0" / "recipe_state" / ".metadata").is_file()
    assert not (reference / "epoch_1" / "recipe_state").exists()  # the final checkpoint needs none
    sharded = sharded_model(reference / "epoch_0" / "recipe_state")
    with open_checkpoint(reference / "epoch_0") as ckpt:
        for name, lazy in ckpt.tensors.items():
            assert torch.equal(lazy.get(), sharded.read(name).to(lazy.get().dtype)), name


@pytest.mark.slow
def test_async_save_killed_before_publishing_keeps_the_previous_checkpoint_and_resumes_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    args = ["checkpointer.async_save=true", f"checkpointer.output_dir={out}"]
    rc = torchrun(["tests/dist_kill_after_save.py", "full_finetune_distributed"], *args,
                  env={"CKPTKIT_KILL_BEFORE": "step_3"})  # fmt: skip
    assert rc != 0
    # step_3 was completely written but never put in place; epoch_0 is whole
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["epoch_0", "metrics.jsonl", "step_1"]
    [partial] = [p for p in out.iterdir() if p.name.startswith(".step_3.") and p.name.endswith(".ckptkit-tmp")]
    assert (partial / "recipe_state" / ".metadata").is_file()
    assert model_files(out / "epoch_0") == model_files(reference / "epoch_0")  # byte for byte
    # resuming in the same output_dir removes what the killed save left and ends where the reference did
    torchrun(RECIPE, *args, *resume(out / "epoch_0"))
    assert not any(p.name.endswith(".ckptkit-tmp") for p in out.iterdir())
    assert losses(out)[-2:] == losses(reference)[2:] and lrs(out)[-2:] == lrs(reference)[2:]
    assert tree_hashes(out / "epoch_1") == tree_hashes(reference / "epoch_1")  # every byte
    saves = [r for r in rows(out) if "checkpoint" in r]
    assert saves and all(r["async"] for r in saves)


@pytest.mark.slow
def test_resume_on_another_number_of_ranks(reference: Path, tmp_path: Path) -> None:
    """2 ranks -> 1 process and 1 process -> 2 ranks, keeping the global batch of 8."""
    import torch._dynamo  # noqa: F401  (imported before the recipe as test_distributed.py does)

    def single(*overrides: str) -> None:
        cfg = load_config("tiny_full_distributed", [*COMMON, "batch_size=8", *overrides])
        recipe_entry("full_finetune_distributed")(cfg)

    # 2 -> 1: the reference's mid-run checkpoint on one process (no torchrun: a group of one)
    single(*resume(reference / "step_1"), f"checkpointer.output_dir={tmp_path / 'two_to_one'}")
    assert_close(losses(tmp_path / "two_to_one"), losses(reference)[1:])
    assert lrs(tmp_path / "two_to_one") == lrs(reference)[1:]  # the schedule's position, exactly
    # 1 -> 2: a one-process run's mid-run checkpoint resumed on 2 ranks
    single(f"checkpointer.output_dir={tmp_path / 'one'}")
    torchrun(RECIPE, *resume(tmp_path / "one" / "step_1"), f"checkpointer.output_dir={tmp_path / 'one_to_two'}")
    assert_close(losses(tmp_path / "one_to_two"), losses(tmp_path / "one")[1:])
    assert lrs(tmp_path / "one_to_two") == lrs(tmp_path / "one")[1:]
    # the float32 weights two steps later (the bf16 files of the final checkpoint round them)
    for resumed, uninterrupted in ((tmp_path / "one_to_two", tmp_path / "one"), (tmp_path / "two_to_one", reference)):
        a, b = (sharded_model(d / "step_3" / "recipe_state") for d in (resumed, uninterrupted))
        assert set(a.entries) == set(b.entries)
        worst = max((a.read(k) - b.read(k)).abs().max().item() for k in a.entries)
        assert 0 < worst < WEIGHT_ATOL, worst


@pytest.mark.slow
def test_lora_resumes_bitwise_from_its_sharded_adapters(tmp_path: Path) -> None:
    """LoRA with ``async_save`` on Phi-3, whose fused qkv_proj and gate_up_proj parts share one
    LoRA A: step checkpoints hold the sharded adapters (and ``adapter/``); a run killed after
    step_2 and resumed ends byte for byte where an uninterrupted one does, and resumed on one
    process it goes on with the 2-process losses and adapters."""
    from safetensors.torch import load_file

    common = ["epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2", "quiet=true", "checkpointer.async_save=true",
              f"checkpointer.checkpoint_dir={FIXTURES / 'hf' / 'phi3'}"]  # fmt: skip
    recipe = ["-m", "ckptkit.train.recipes.lora_finetune_distributed"]
    torchrun(recipe, *common, f"checkpointer.output_dir={tmp_path / 'whole'}", config="tiny_lora")
    killed = tmp_path / "killed"
    rc = torchrun(["tests/dist_kill_after_save.py", "lora_finetune_distributed"], *common,
                  f"checkpointer.output_dir={killed}", env={"CKPTKIT_KILL_AFTER": "step_2"},
                  config="tiny_lora")  # fmt: skip
    assert rc != 0 and not (killed / "epoch_0").exists()
    assert sorted(p.name for p in (killed / "step_2").iterdir()) == ["adapter", "recipe_state"]
    state = sharded_model(killed / "step_2" / "recipe_state")
    keys = set(state.entries)
    assert keys and all(k.endswith((".lora_a", ".lora_b")) for k in keys)  # the frozen base is not copied
    shares = {"attn.k_proj": "attn.q_proj", "attn.v_proj": "attn.q_proj", "mlp.w3": "mlp.w1"}
    for part, first in shares.items():  # one A per fused module, trained as one
        assert torch.equal(state.read(f"layers.0.{part}.lora_a"), state.read(f"layers.0.{first}.lora_a"))
    torchrun(recipe, *common, *resume(killed / "step_2"), f"checkpointer.output_dir={tmp_path / 'resumed'}",
             config="tiny_lora")  # fmt: skip
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")[2:]
    assert tree_hashes(tmp_path / "resumed" / "epoch_0") == tree_hashes(tmp_path / "whole" / "epoch_0")
    # 2 -> 1: the same checkpoint on one process (no torchrun: a group of one), the same global batch
    cfg = load_config("tiny_lora_distributed", [*common, *resume(killed / "step_2"), "batch_size=8",
                                                f"checkpointer.output_dir={tmp_path / 'one'}"])  # fmt: skip
    recipe_entry("lora_finetune_distributed")(cfg)
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "whole")[2:])
    a, b = (load_file(tmp_path / d / "epoch_0" / "adapter" / "adapter_model.safetensors") for d in ("one", "whole"))
    assert list(a) == list(b) and max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_ATOL


class _Boom:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.target}",))


def test_resuming_from_a_hostile_recipe_state_runs_nothing(tmp_path: Path) -> None:
    """torch's ``dcp.load`` unpickles ``.metadata`` as it is: the recipe reads it with the
    restricted reader first and stops with one line."""
    state, target = tmp_path / "recipe_state", tmp_path / "pwned"
    state.mkdir()
    (state / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Boom(str(target))}))
    proc = ckptkit("run", "full_finetune_distributed", "--config", "tiny_full_distributed", *COMMON,
                   f"checkpointer.output_dir={tmp_path / 'out'}", *resume(state))  # fmt: skip
    assert proc.exit_code == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.output[-3000:]
    assert "refusing to load" in proc.stderr and "posix.system" in proc.stderr
    assert not target.exists()
