"""Memory while saving: full_finetune_distributed on 2 gloo processes vs full_finetune on one.

A Llama of about 300M parameters is written by transformers' ``save_pretrained`` (bf16,
several safetensors shards) and trained 2 steps in bf16 with AdamW (batch 1 per rank, 32
tokens); a mid-run checkpoint (model + optimizer state) is written after step 1. The
distributed recipe records, per rank, RSS just before each save and the peak RSS during it
(``VmHWM`` reset before the save); each run's whole-process peak comes from ``wait4``
(for torchrun: its largest worker). Weights + AdamW state = 3 x the bf16 weight bytes.

    python bench/dist_save_memory.py                      # ~300M parameters
    python bench/dist_save_memory.py --hidden 512 --layers 8   # a quick ~60M check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from report import reporting

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "hf" / "llama2"  # its tokenizer (ids < 384 fit any vocabulary)


def make_model(path: Path, hidden: int, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        intermediate_size=hidden * 11 // 4, vocab_size=32000, max_position_embeddings=512,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="200MB")
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, path / name)
    return model.num_parameters()


def config(model: Path, out: Path, batch: int) -> dict:
    return {
        "seed": 0, "device": "cpu", "dtype": "bf16", "quiet": True,
        "checkpointer": {"checkpoint_dir": str(model), "output_dir": str(out)},
        "dataset": {"type": "instruct", "source": "tiny_alpaca", "max_seq_len": 32, "train_on_input": True},
        "epochs": 1, "batch_size": batch, "max_steps_per_epoch": 2, "save_every_n_steps": 1,
        "optimizer": {"lr": 1e-5}, "clip_grad_norm": 1.0,
    }  # fmt: skip


def run(cmd: list[str]) -> tuple[float, float, float]:
    """(wall s, user+sys s, peak RSS MiB) of one command and its descendants."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            log.seek(0)
            errors = [line for line in log.read().decode().splitlines() if line.startswith("error")]
            sys.exit(f"{' '.join(cmd)} failed: {' / '.join(errors) or 'see its output'}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptkit-dist-mem-") as tmp:
        root = Path(tmp)
        params = make_model(root / "model", args.hidden, args.layers)
        weights = params * 2 / 2**20
        rows = []
        for name, nproc in (("full_finetune (1 process)", 0), ("full_finetune_distributed (2 ranks)", 2)):
            out = root / f"out{nproc}"
            cfg_path = root / f"cfg{nproc}.yaml"
            cfg_path.write_text(yaml.safe_dump(config(root / "model", out, 2 if nproc == 0 else 1)))
            if nproc == 0:
                cmd = [sys.executable, "-m", "ckptkit", "run", "full_finetune", "--config", str(cfg_path)]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "-m", "ckptkit.train.recipes.full_finetune_distributed", "--config", str(cfg_path)]  # fmt: skip
            wall, cpu, peak = run(cmd)
            saves = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            saves = [s for s in saves if "peak_rss_mib_save" in s]
            rows.append((name, wall, cpu, peak, saves))
        print(f"model: {params / 1e6:.0f}M parameters; bf16 weights {weights:.0f} MiB, "
              f"weights + AdamW state {3 * weights:.0f} MiB\n")  # fmt: skip
        columns = ["run", "wall s", "user+sys s", "whole-run peak RSS MiB (largest process)",
                   "per-rank RSS before -> peak during mid-run save, MiB"]  # fmt: skip
        print("| " + " | ".join(columns) + " |")
        print("|---|---|---|---|---|")
        for name, wall, cpu, peak, saves in rows:
            mid = next((s for s in saves if "step_" in s["checkpoint"]), None)
            during = (", ".join(f"{b} -> {p}" for b, p in zip(mid["rss_mib_before_save"], mid["peak_rss_mib_save"],
                                                               strict=True)) if mid else "n/a")  # fmt: skip
            print(f"| {name} | {wall:.1f} | {cpu:.1f} | {peak:.0f} | {during} |")


if __name__ == "__main__":
    with reporting("dist_save_memory.py"):
        main()
