"""The FSDP2 recipes on CPU with gloo and 2 processes (torchrun), against the single-device ones.

Tolerances: the 2-process run sums each rank's token losses and all-reduces them, and
reduce-scatters gradients, so float32 sums are added in another order than on one device:
per-step losses agree to 1e-5 relative (measured 2e-7), float32 weights after 6 AdamW
steps to 1e-4 absolute (measured 1e-5), LoRA adapters after 3 steps at lr 2e-2 to 5e-4
(measured 6e-5); each run's bf16 merged weights equal PEFT's merge of its adapter to one
bf16 rounding step (measured: bitwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config, parse_config
from ckptkit.train.recipes import launch_torchrun, recipe_entry

from conftest import FIXTURES, raw_layout, tree_hashes
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4
ADAPTER_ATOL = 5e-4


def torchrun(target: list[str], *args: str, nproc: int = 2, env: dict[str, str] | None = None) -> int:
    """``torchrun --standalone --nproc-per-node N TARGET ARGS`` from the repository root; its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if env is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


def run_single(recipe: str, config: str, *overrides: str) -> None:
    recipe_entry(recipe)(load_config(config, list(overrides)))


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics(output_dir) if "loss" in r]


def assert_close_losses(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert all(abs(x - y) <= LOSS_RTOL * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def assert_same_names_partition_dtypes(a: Path, b: Path) -> dict[str, float]:
    """Same weight files, same tensor names in the same order, same dtypes and shapes; returns
    the largest absolute difference per file."""
    la, lb = raw_layout(a), raw_layout(b)
    assert list(la) == list(lb)
    worst = {}
    for name in la:
        assert [(k, t.dtype, t.shape) for k, t in la[name]] == [(k, t.dtype, t.shape) for k, t in lb[name]]
        pairs = zip(la[name], lb[name], strict=True)
        worst[name] = max((ta.float() - tb.float()).abs().max().item() for (_, ta), (_, tb) in pairs)
    for index in a.glob("*.index.json"):
        assert json.loads(index.read_text())["weight_map"] == json.loads((b / index.name).read_text())["weight_map"]
    return worst


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bfloat16 tensors, in representable bfloat16 steps."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape

    def ordered(t: torch.Tensor) -> torch.Tensor:  # the bit patterns as integers in value order
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max())


def merged_by_ckptkit_and_peft(run: Path, hf: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA run's merged weights (converted to HF names) and PEFT's merge of the run's
    adapter into the HF copy of its base, cast to the base's bfloat16."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    convert(run, hf, ConvertOptions("hf"))
    ours = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, run / "adapter").merge_and_unload().state_dict()
    return ours, {k: merged[k].to(torch.bfloat16) for k in ours}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A float32 copy of the Llama 2 fixture, trained 6 steps (checkpoints every 2) on one
    device with batch 8 and on 2 processes with batch 4 each."""
    root = tmp_path_factory.mktemp("full")
    base = root / "base"
    convert(FIXTURES / "hf" / "llama2", base, ConvertOptions("hf", dtype="float32"))
    common = ["epochs=1", "save_every_n_steps=2", "quiet=true", f"checkpointer.checkpoint_dir={base}"]
    run_single("full_finetune", "tiny_full", *common, f"checkpointer.output_dir={root / 'single'}")
    target = ["-m", "ckptkit.train.recipes.full_finetune_distributed"]
    torchrun(target, "--config", "tiny_full_distributed", *common, f"checkpointer.output_dir={root / 'dist'}")
    return {"root": root, "base": base, "single": root / "single", "dist": root / "dist", "common": common}


@pytest.mark.slow
def test_full_two_processes_match_one_device(full_runs: dict) -> None:
    from transformers import AutoModelForCausalLM

    single, dist = full_runs["single"], full_runs["dist"]
    assert_close_losses(losses(single), losses(dist))
    worst = assert_same_names_partition_dtypes(single / "epoch_0", dist / "epoch_0")
    assert max(worst.values()) < WEIGHT_ATOL, worst
    assert sorted(p.name for p in (dist / "epoch_0").iterdir()) == sorted(
        p.name for p in (single / "epoch_0").iterdir()
    )
    ours = {k: t for f in raw_layout(dist / "epoch_0").values() for k, t in f}
    hf = AutoModelForCausalLM.from_pretrained(dist / "epoch_0", dtype=torch.float32).state_dict()
    assert set(hf) == set(ours) and all(torch.equal(hf[k], t) for k, t in ours.items())
    # the mid-epoch checkpoint carries a DCP recipe state with one shard file per rank
    files = sorted(p.name for p in (dist / "step_2" / "recipe_state").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_killed_run_resumes_exactly_and_on_one_process(full_runs: dict) -> None:
    root, common, dist = full_runs["root"], full_runs["common"], full_runs["dist"]
    killed = root / "killed"
    args = ["--config", "tiny_full_distributed", *common, f"checkpointer.output_dir={killed}"]
    rc = torchrun(["tests/dist_kill_after_save.py", "full_finetune_distributed"], *args,
                  env={"CKPTKIT_KILL_AFTER": "step_2"})  # fmt: skip
    assert rc != 0 and (killed / "step_2").is_dir() and not (killed / "step_4").exists()
    resume = ["resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={killed / 'step_2' / 'recipe_state'}"]
    target = ["-m", "ckptkit.train.recipes.full_finetune_distributed"]
    torchrun(target, "--config", "tiny_full_distributed", *common, *resume, f"checkpointer.output_dir={root / 'r2'}")
    assert tree_hashes(root / "r2" / "epoch_0") == tree_hashes(dist / "epoch_0")  # every byte
    assert losses(root / "r2") == losses(dist)[2:]
    # one process (no torchrun: a group of one), the same global batch: the curve goes on
    run_single("full_finetune_distributed", "tiny_full_distributed", *common, *resume, "batch_size=8",
               f"checkpointer.output_dir={root / 'r1'}")  # fmt: skip
    assert_close_losses(losses(root / "r1"), losses(dist)[2:])
    worst = assert_same_names_partition_dtypes(root / "r1" / "epoch_0", dist / "epoch_0")
    assert max(worst.values()) < WEIGHT_ATOL, worst
    # another global batch would shift the data position: refused in one line
    with pytest.raises(CkptkitError, match="global batch of 8 samples .* set batch_size"):
        run_single("full_finetune_distributed", "tiny_full_distributed", *common, *resume, "batch_size=4",
                   f"checkpointer.output_dir={root / 'r3'}")  # fmt: skip


@pytest.mark.slow
def test_lora_meta_two_rank_in_and_out(tmp_path: Path) -> None:
    """LoRA (activation checkpointing on) from the Meta 2-rank fixture, launched by ``ckptkit run``."""
    from safetensors.torch import load_file

    base = FIXTURES / "meta" / "llama2-2rank"
    common = ["epochs=1", "max_steps_per_epoch=3", "quiet=true", f"checkpointer.checkpoint_dir={base}"]
    run_single("lora_finetune", "tiny_lora", *common, f"checkpointer.output_dir={tmp_path / 'single'}")
    cmd = [sys.executable, "-m", "ckptkit", "run", "--nproc-per-node", "2", "lora_finetune_distributed",
           "--config", "tiny_lora_distributed", *common, "enable_activation_checkpointing=true",
           f"checkpointer.output_dir={tmp_path / 'dist'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_losses(losses(tmp_path / "single"), losses(tmp_path / "dist"))
    single, dist = tmp_path / "single" / "epoch_0", tmp_path / "dist" / "epoch_0"
    assert sorted(p.name for p in dist.iterdir()) == sorted(p.name for p in single.iterdir())
    assert [p.name for p in sorted(dist.glob("consolidated.*.pth"))] == ["consolidated.00.pth", "consolidated.01.pth"]
    assert_same_names_partition_dtypes(single, dist)  # bf16 merged weights, laid out alike
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (single, dist))
    assert list(a) == list(b) and max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_ATOL
    # each run's merged weights are PEFT's merge of its own adapter into the base, to a bf16
    # rounding step (float32 B @ A summed in another order may round the other way; measured 0)
    merged = {run: merged_by_ckptkit_and_peft(run, tmp_path / f"{run.parent.name}_hf") for run in (single, dist)}
    for run, (ours, peft) in merged.items():
        worst = {k: bf16_ulps(ours[k], peft[k]) for k in peft}
        assert max(worst.values()) <= 1, (run, worst)
    # (so the runs' merged weights differ only by what their adapters do, within ADAPTER_ATOL)
    configs = [json.loads((d / "adapter" / "adapter_config.json").read_text()) for d in (single, dist)]
    bases = [c.pop("base_model_name_or_path") for c in configs]  # each run's HF copy of the Meta base
    assert configs[0] == configs[1] and bases[1] == str((tmp_path / "dist" / "base_hf").resolve())


@pytest.mark.slow
def test_no_rank_holds_the_whole_model_while_saving(tmp_path: Path) -> None:
    """A 58M-parameter Llama (bf16: 117 MB of weights, 350 MB with AdamW state): neither during
    the mid-run save (each rank's shards) nor the final one (shards, then the model files
    converted from them on rank 0) does any rank's RSS grow by the model's size.
    bench/dist_save_memory.py measures the same on ~300M parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         intermediate_size=1408, vocab_size=32000, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    weight_mib = model.num_parameters() * 2 / 2**20
    model.save_pretrained(tmp_path / "base", max_shard_size="50MB")
    del model
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "base" / name).write_bytes((FIXTURES / "hf" / "llama2" / name).read_bytes())
    torchrun(["-m", "ckptkit.train.recipes.full_finetune_distributed"], "--config", "tiny_full_distributed",
             f"checkpointer.checkpoint_dir={tmp_path / 'base'}", f"checkpointer.output_dir={tmp_path / 'out'}",
             "dtype=bf16", "batch_size=1", "epochs=1", "max_steps_per_epoch=2", "save_every_n_steps=1",
             "dataset.max_seq_len=32", "dataset.train_on_input=true", "quiet=true")  # fmt: skip
    saves = {Path(r["checkpoint"]).name: r for r in metrics(tmp_path / "out") if "checkpoint" in r}
    assert list(saves) == ["step_1", "epoch_0"]  # sharded state only; sharded state converted on rank 0
    for save in saves.values():
        growth = [p - b for b, p in zip(save["rss_mib_before_save"], save["peak_rss_mib_save"], strict=True)]
        assert len(growth) == 2 and max(growth) < 0.75 * weight_mib, (growth, weight_mib)
    names = [sorted(p.name for p in d.glob("model*")) for d in (tmp_path / "base", tmp_path / "out" / "epoch_0")]
    assert len(names[0]) > 2 and names[0] == names[1]  # the input's shard partition


def test_launch_and_resume_mistakes_are_one_line(tmp_path: Path) -> None:
    proc = ckptkit("run", "--nproc-per-node", "2", "full_finetune_distributed", "--config", "tiny_full_distributed",
                   f"checkpointer.checkpoint_dir={tmp_path / 'missing'}")  # fmt: skip
    assert proc.exit_code == 1 and proc.stderr.strip().splitlines() == [
        f"error: {REPO / 'ckptkit/train/configs/tiny_full_distributed.yaml'} with the KEY=VALUE overrides: "
        f"config key checkpointer.checkpoint_dir: {tmp_path / 'missing'}: no such file or directory"
    ]
    with pytest.raises(CkptkitError, match="full_finetune runs on one device; use full_finetune_distributed"):
        launch_torchrun("full_finetune", 2, "tiny_full", [], load_config("tiny_full"))
    (tmp_path / "state").mkdir()
    with pytest.raises(CkptkitError, match="no distributed recipe state there; set checkpointer.recipe_checkpoint"):
        run_single("lora_finetune_distributed", "tiny_lora_distributed", "resume_from_checkpoint=true",
                   f"checkpointer.recipe_checkpoint={tmp_path / 'state'}", f"checkpointer.output_dir={tmp_path / 'o'}",
                   f"checkpointer.checkpoint_dir={FIXTURES / 'hf' / 'llama2'}")  # fmt: skip


def test_bundled_distributed_configs_validate() -> None:
    from ckptkit.train.recipes import RECIPES
    from ckptkit.train.schema import FullFinetuneDistributedConfig, LoRAFinetuneDistributedConfig

    schemas = {"full_finetune_distributed": FullFinetuneDistributedConfig,
               "lora_finetune_distributed": LoRAFinetuneDistributedConfig}  # fmt: skip
    for recipe, schema in schemas.items():
        for name in RECIPES[recipe]:
            cfg = parse_config(load_config(name), schema)
            assert cfg.batch_size >= 1 and cfg.mixed_precision.param_dtype in (None, "fp32", "bf16")


@pytest.mark.slow
def test_a_failure_on_rank_0_stops_every_rank_with_its_line(tmp_path: Path) -> None:
    """Rank 0 alone takes a checkpoint folder's lock and writes the metrics. When that fails (another
    writer holds ``epoch_0``; the output folder is a file) every rank exits, rank 0 with its one
    line, the others silently (they only learned of it): none is left in a collective waiting for it
    (the timeout fails the test), none has a traceback."""
    from ckptkit.io.publish import leftovers, locked

    def launch(out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "ckptkit", "run", "--nproc-per-node", "2", "full_finetune_distributed",
               "--config", "tiny_full_distributed", "epochs=1", "max_steps_per_epoch=1", "quiet=true",
               f"checkpointer.output_dir={out}"]  # fmt: skip
        # torchrun stops the other workers once one has failed: here, not before 2 s have passed
        env = {**os.environ, "PET_MONITOR_INTERVAL": "2"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]

    out = tmp_path / "out"
    out.mkdir()
    with locked(out / "epoch_0"):
        lines = launch(out)
    held = f"{out / 'epoch_0'}: another ckptkit process is writing it (pid {os.getpid()})"
    assert lines[:1] == [f"error: [rank 0] {held}; wait for it to finish or choose another DST"]
    assert lines[1:] == ["error: full_finetune_distributed: 2 of 2 processes failed (exit code 1)"]
    assert not (out / "epoch_0").exists() and leftovers(out) == []  # no checkpoint, nothing half-written

    (tmp_path / "file").write_text("")
    lines = launch(tmp_path / "file")
    assert lines[:1] == [f"error: [rank 0] {tmp_path / 'file'}: File exists"]
    assert lines[1:] == ["error: full_finetune_distributed: 2 of 2 processes failed (exit code 1)"]
