"""The training recipes: loss goes down, resume is exact, outputs keep the input's format."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.train.config import load_config
from ckptkit.train.recipes import recipe_entry

from conftest import FIXTURES, tree_hashes
from train_helpers import ckptkit

REPO = Path(__file__).resolve().parents[2]
EPS32 = torch.finfo(torch.float32).eps


def losses(output_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def run(recipe: str, config: str, *overrides: str) -> None:
    recipe_entry(recipe)(load_config(config, list(overrides)))


@pytest.mark.parametrize(
    ("recipe", "config", "bound"), [("full_finetune", "tiny_full", 0.7), ("lora_finetune", "tiny_lora", 0.8)]
)
def test_cli_run_lowers_the_loss(
    recipe: str, config: str, bound: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    monkeypatch.chdir(REPO)
    result = ckptkit("run", recipe, "--config", config, f"checkpointer.output_dir={out}")
    assert result.exit_code == 0, result.output[-3000:]
    curve = losses(out)
    last_epoch = curve[-6:]  # 48 samples / batch 8 = 6 steps per epoch
    assert sum(last_epoch) / len(last_epoch) < bound * curve[0], curve
    final = out / "epoch_3"
    assert not (final / "recipe_state").exists()  # the final checkpoint needs none
    assert (out / "epoch_2" / "recipe_state" / "recipe_state.pt").exists()


@pytest.mark.parametrize(("recipe", "config"), [("full_finetune", "tiny_full"), ("lora_finetune", "tiny_lora")])
def test_resume_is_bitwise_exact(recipe: str, config: str, tmp_path: Path) -> None:
    common = ["epochs=2", "save_every_n_steps=5"]
    if recipe == "lora_finetune":
        common.append("lora.dropout=0.1")  # dropout: the RNG must be restored too
    run(recipe, config, *common, f"checkpointer.output_dir={tmp_path / 'a'}")
    mid = tmp_path / "a" / "step_05"  # mid-epoch 0; 12 steps in all, so two digits
    resume = ["resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={mid}"]  # the folder is enough
    run(recipe, config, *common, *resume, f"checkpointer.output_dir={tmp_path / 'b'}")
    a, b = tree_hashes(tmp_path / "a" / "epoch_1"), tree_hashes(tmp_path / "b" / "epoch_1")
    assert a == b  # weights, adapter, config: every byte
    assert losses(tmp_path / "a")[5:] == losses(tmp_path / "b")


def test_lora_merged_output_equals_peft_merge(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    convert(FIXTURES / "hf" / "llama3", base, ConvertOptions("hf", dtype="float32"))  # float32 in, float32 out
    run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=3", f"checkpointer.checkpoint_dir={base}",
        f"checkpointer.output_dir={tmp_path / 'out'}")  # fmt: skip
    ours_dir = tmp_path / "out" / "epoch_0"
    ours = AutoModelForCausalLM.from_pretrained(ours_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), ours_dir / "adapter"
    )
    merged = peft.merge_and_unload()
    theirs = merged.state_dict()
    worst = max((v - theirs[k]).abs().max().item() for k, v in ours.state_dict().items())
    assert worst < 1e-6  # float32 rounding of W + s * B @ A
    base_sd = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    assert not torch.equal(
        base_sd["model.layers.0.self_attn.q_proj.weight"], theirs["model.layers.0.self_attn.q_proj.weight"]
    )
    ids = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids).logits - merged(ids).logits).abs().max().item() < 1e-5


def test_outputs_keep_the_input_format(tmp_path: Path) -> None:
    src = FIXTURES / "meta" / "llama2-2rank"
    before = tree_hashes(src)
    run("lora_finetune", "tiny_lora", "epochs=1", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={src}",
        f"checkpointer.output_dir={tmp_path / 'meta'}")  # fmt: skip
    out = tmp_path / "meta" / "epoch_0"
    assert sorted(p.name for p in out.glob("consolidated.*")) == ["consolidated.00.pth", "consolidated.01.pth"]
    assert (out / "params.json").read_bytes() == (src / "params.json").read_bytes()
    assert {"adapter_model.safetensors", "adapter_config.json"} == {p.name for p in (out / "adapter").iterdir()}
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    assert tree_hashes(src) == before

    src = FIXTURES / "hf-bin" / "llama2"
    run("full_finetune", "tiny_full", "epochs=1", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={src}",
        f"checkpointer.output_dir={tmp_path / 'bin'}")  # fmt: skip
    out = tmp_path / "bin" / "epoch_0"
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(p.name for p in src.glob("*.bin"))
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert index == json.loads((src / "pytorch_model.bin.index.json").read_text())
    shard = torch.load(out / "pytorch_model-00001-of-00002.bin", weights_only=True)
    assert shard["model.layers.0.self_attn.rotary_emb.inv_freq"].dtype == torch.float32  # carried over


def test_resume_errors_name_the_config_key(tmp_path: Path) -> None:
    out = f"checkpointer.output_dir={tmp_path / 'x'}"
    with pytest.raises(CkptkitError, match="checkpointer.recipe_checkpoint is not set"):
        run("full_finetune", "tiny_full", "resume_from_checkpoint=true", out)
    with pytest.raises(
        CkptkitError, match=r"recipe_state.pt: recipe state not found; set checkpointer.recipe_checkpoint"
    ):
        run("full_finetune", "tiny_full", "resume_from_checkpoint=true",
            f"checkpointer.recipe_checkpoint={tmp_path / 'nope' / 'recipe_state.pt'}", out)  # fmt: skip
    run("lora_finetune", "tiny_lora", "epochs=2", "max_steps_per_epoch=1", f"checkpointer.output_dir={tmp_path / 'a'}")
    state = tmp_path / "a" / "epoch_0" / "recipe_state" / "recipe_state.pt"
    with pytest.raises(CkptkitError, match="epochs=2 but the config says 3"):
        run("lora_finetune", "tiny_lora", "epochs=3", "max_steps_per_epoch=1", "resume_from_checkpoint=true",
            f"checkpointer.recipe_checkpoint={state}", out)  # fmt: skip
    with pytest.raises(CkptkitError, match="checkpointer.adapter_checkpoint"):
        run("lora_finetune", "tiny_lora", "epochs=2", "max_steps_per_epoch=1", "resume_from_checkpoint=true",
            f"checkpointer.recipe_checkpoint={state}", f"checkpointer.adapter_checkpoint={tmp_path}", out)  # fmt: skip
    with pytest.raises(CkptkitError, match="adapts other modules"):
        run("lora_finetune", "tiny_lora", "epochs=2", "max_steps_per_epoch=1", "resume_from_checkpoint=true",
            "lora.targets=[q]", f"checkpointer.recipe_checkpoint={state}",
            f"checkpointer.adapter_checkpoint={state.parent.parent}", out)  # fmt: skip


def test_bad_data_row_names_its_line(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c"}\n')
    with pytest.raises(CkptkitError, match=rf"{data}:3: missing or non-string field\(s\): output"):
        run("full_finetune", "tiny_full", f"dataset.source={data}", f"checkpointer.output_dir={tmp_path / 'o'}")
    data.write_text('{"instruction": "a", "output": "b"}\n{oops\n')
    res = ckptkit("run", "full_finetune", "--config", "tiny_full", f"dataset.source={data}",
                  f"checkpointer.output_dir={tmp_path / 'o'}")  # fmt: skip
    assert res.exit_code == 1 and res.exception is not None and isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and f"{data}:2: invalid JSON" in res.stderr


def test_text_completion_data_trains(tmp_path: Path) -> None:
    """Trained on plain text, the saved model predicts that text better than the base does
    (the loss transformers computes on it), and the logged loss falls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run("full_finetune", "tiny_full", "dataset.type=text", "dataset.source=tiny_corpus", "dataset.max_seq_len=64",
        "batch_size=2", "epochs=1", f"checkpointer.output_dir={tmp_path / 'o'}")  # fmt: skip
    curve = losses(tmp_path / "o")
    assert len(curve) > 5 and sum(curve[-5:]) / 5 < 0.9 * curve[0], curve
    corpus = (REPO / "ckptkit" / "train" / "datasets" / "tiny_corpus.txt").read_text().splitlines()[:8]
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "hf" / "llama2")
    lines = [tokenizer(line, return_tensors="pt")["input_ids"] for line in corpus]

    def text_loss(folder: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return sum(model(input_ids=ids, labels=ids).loss.item() for ids in lines) / len(lines)

    assert text_loss(tmp_path / "o" / "epoch_0") < 0.9 * text_loss(FIXTURES / "hf" / "llama2")


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptkit.train.checkpointer as ck

    common = ["epochs=2", "max_steps_per_epoch=1", f"checkpointer.output_dir={tmp_path}"]
    run("lora_finetune", "tiny_lora", *common)
    before = tree_hashes(tmp_path / "epoch_1")

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_adapter", crash)
    with pytest.raises(OSError):  # resumed from epoch_0, it saves epoch_1 again
        run("lora_finetune", "tiny_lora", *common, "resume_from_checkpoint=true",
            f"checkpointer.recipe_checkpoint={tmp_path / 'epoch_0'}")  # fmt: skip
    assert tree_hashes(tmp_path / "epoch_1") == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ls_and_cp(tmp_path: Path) -> None:
    res = ckptkit("ls")
    assert res.exit_code == 0 and "full_finetune" in res.stdout and "tiny_lora" in res.stdout
    assert ckptkit("cp", "lora_finetune", str(tmp_path)).exit_code == 0
    assert ckptkit("cp", "tiny_lora", str(tmp_path / "my.yaml")).exit_code == 0
    again = ckptkit("cp", "tiny_lora", str(tmp_path / "my.yaml"))
    assert again.exit_code == 1 and "already exists" in again.stderr
    # the copied recipe runs as a file
    run(str(tmp_path / "lora_finetune.py"), str(tmp_path / "my.yaml"), "epochs=1", "max_steps_per_epoch=1",
        f"checkpointer.output_dir={tmp_path / 'o'}")  # fmt: skip
    assert (tmp_path / "o" / "epoch_0" / "adapter" / "adapter_model.safetensors").exists()


def copy_and_edit(recipe: str, folder: Path) -> Path:
    """``ckptkit cp RECIPE``, then two edits in the loop it holds: every optimizer step prints a
    line, and the loss it reports is doubled."""
    assert ckptkit("cp", recipe, str(folder)).exit_code == 0
    path = folder / f"{recipe}.py"
    text = path.read_text()
    step, loss = "        self.optimizer.step()\n", "        return stats.loss, sum("
    assert text.count(step) == text.count(loss) == 1  # the loop itself is in the copy, not an import of it
    text = text.replace(step, "        print(f'edited step on rank {self.placement.rank}', flush=True)\n" + step)
    path.write_text(text.replace(loss, "        return 2 * stats.loss, sum("))
    return path


def test_a_copied_recipe_is_the_loop_to_edit(tmp_path: Path) -> None:
    """``ckptkit cp full_finetune`` writes the training loop as one script: edits to it change what
    ``ckptkit run ./full_finetune.py`` does; the bundled recipe is untouched by them."""
    script = copy_and_edit("full_finetune", tmp_path)
    keys = ["epochs=1", "max_steps_per_epoch=2", "quiet=true"]
    cmd = ["run", str(script), "--config", "tiny_full", *keys]
    edited = ckptkit(*cmd, f"checkpointer.output_dir={tmp_path / 'edited'}")
    assert edited.exit_code == 0, edited.output[-3000:]
    assert edited.stdout.splitlines() == ["edited step on rank 0"] * 2
    run("full_finetune", "tiny_full", *keys, f"checkpointer.output_dir={tmp_path / 'bundled'}")
    ours, theirs = losses(tmp_path / "edited"), losses(tmp_path / "bundled")
    assert len(ours) == 2 and ours[0] == 2 * theirs[0]  # step 1 computes the same loss before any update
    proc = ckptkit(*cmd[:2], "--nproc-per-node", "2", *cmd[2:])
    assert proc.exit_code == 2  # bad usage
    assert proc.stderr.strip() == f"error: {script}: runs on one device; run it without --nproc-per-node"


@pytest.mark.slow
def test_a_copied_distributed_recipe_runs_under_torchrun(tmp_path: Path) -> None:
    """``ckptkit cp full_finetune_distributed``: the edited loop runs on every rank of ``ckptkit run
    --nproc-per-node 2 ./full_finetune_distributed.py``."""
    script = copy_and_edit("full_finetune_distributed", tmp_path)
    cmd = [sys.executable, "-m", "ckptkit", "run", "--nproc-per-node", "2", str(script), "--config",
           "tiny_full_distributed", "epochs=1", "max_steps_per_epoch=2", "quiet=true",
           f"checkpointer.output_dir={tmp_path / 'o'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the ranks print at once: counted, since their lines may interleave in the one pipe
    assert [proc.stdout.count(f"edited step on rank {r}") for r in (0, 1)] == [2, 2]
    assert (tmp_path / "o" / "epoch_0").is_dir()


def test_activation_checkpointing_bf16_and_accumulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkit.train import layers

    calls = {"mlp": 0}
    forward = layers.GatedMLP.forward

    def counted(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls["mlp"] += 1
        return forward(self, x)

    monkeypatch.setattr(layers.GatedMLP, "forward", counted)
    one = ["epochs=1", "max_steps_per_epoch=2"]
    run("full_finetune", "tiny_full", *one, f"checkpointer.output_dir={tmp_path / 'plain'}")
    plain, calls["mlp"] = calls["mlp"], 0
    run("full_finetune", "tiny_full", *one, "enable_activation_checkpointing=true",
        f"checkpointer.output_dir={tmp_path / 'ac'}")  # fmt: skip
    assert plain > 0 and calls["mlp"] == 2 * plain  # each block's forward runs again in the backward
    assert losses(tmp_path / "plain") == losses(tmp_path / "ac")  # recomputation changes memory, not numbers
    assert tree_hashes(tmp_path / "plain" / "epoch_0") == tree_hashes(tmp_path / "ac" / "epoch_0")
    run("lora_finetune", "tiny_lora", *one, "dtype=bf16", f"checkpointer.output_dir={tmp_path / 'bf16'}")
    assert len(losses(tmp_path / "bf16")) == 2 and all(map(math.isfinite, losses(tmp_path / "bf16")))
    run("full_finetune", "tiny_full", *one, "batch_size=4", "gradient_accumulation_steps=2",
        f"checkpointer.output_dir={tmp_path / 'accum'}")  # fmt: skip
    # two optimizer steps, each over two batches of 4: the steps of batch 8 up to float32 summation order
    accum, big = losses(tmp_path / "accum"), losses(tmp_path / "plain")
    assert len(accum) == 2 and all(abs(a - b) <= 4 * EPS32 * b for a, b in zip(accum, big, strict=True)), (accum, big)
