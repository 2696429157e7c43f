"""Activation offloading (peak memory) in the recipes, with and without checkpointing.

ckptkit's ``lora_finetune`` recipe, each run its own process under GNU ``time`` (peak RSS),
on a small Llama written by transformers' ``save_pretrained`` (bench/train.py's model
builder, float32), on fixed-length chunks of the fixture corpus, ``--seq`` x ``--batch``, a
few steps with: nothing, ``enable_activation_checkpointing``, checkpointing plus
``enable_activation_offloading`` (on CPU: saved activations to files in the output folder),
and offloading alone. Every mode must log the same losses (offloading changes where
activations live, not what they are); peak RSS includes torch and the weights, so the
activations' share is the difference between the rows. (Packed vs padded batches: bench/train.py.)

    python bench/activations.py                          # CPU, prints a markdown table
    python bench/activations.py --device cuda --seq 4096 # peak = torch.cuda.max_memory_allocated
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

from report import reporting
from train import MODEL, make_model

MODES = {
    "plain": {},
    "checkpointing": {"enable_activation_checkpointing": True},
    "checkpointing+offloading": {"enable_activation_checkpointing": True, "enable_activation_offloading": True},
    "offloading": {"enable_activation_offloading": True},
}


def config(mode: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    data = {"type": "text", "source": str(model / "data.txt"), "max_seq_len": args.seq}
    steps = {"epochs": 1, "batch_size": args.batch, "max_steps_per_epoch": args.steps}
    cfg: dict = {
        "seed": 0, "device": args.device, "dtype": "fp32", "quiet": True,
        "checkpointer": {"checkpoint_dir": str(model), "output_dir": str(out)},
        "dataset": data, **steps, "optimizer": {"lr": 1e-4}, "lr_scheduler": {"warmup_steps": 0},
        "lora": {"rank": 8, "alpha": 16, "targets": ["q", "k", "v", "o"], "dropout": 0.0, "save_merged": "never"},
    }  # fmt: skip
    for key, value in MODES[mode].items():
        section, _, name = key.rpartition(".")
        (cfg[section] if section else cfg)[name] = value
    return cfg


def worker(mode: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    """Run the recipe, clocking each optimizer step: per-step tokens and seconds, losses, CUDA peak."""
    import torch

    from ckptkit.train.loop import Recipe, run

    clock: list[tuple[int, float]] = []
    step = Recipe._step

    def timed_step(self, batches):  # the recipe's own step
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, tokens = step(self, batches)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        clock.append((tokens, time.perf_counter() - start))
        return loss, tokens

    Recipe._step = timed_step  # type: ignore[method-assign]
    try:
        run(config(mode, model, out, args), "lora_finetune")
    finally:
        Recipe._step = step  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cuda_peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    return {"losses": [r["loss"] for r in rows if "loss" in r], "clock": clock, "cuda_peak": cuda_peak}


def measure(mode: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    """One worker in its own process under GNU time: its report plus peak RSS."""
    out = work / f"out-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    stats = work / f"{mode}.time"
    cmd = [sys.executable, __file__, "--worker", mode, "--model", str(model), "--out", str(out),
           *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in vars(args).items()
                 if k in ("device", "seq", "batch", "steps")), [])]  # fmt: skip
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(stats), *cmd], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed with status {proc.returncode}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["peak_rss_mb"] = int(stats.read_text().split()[-1]) / 1024
    timed = got["clock"][1:]  # the first step warms up
    got["tokens_per_s"] = sum(t for t, _ in timed) / sum(s for _, s in timed)
    got["tokens_per_step"] = sum(t for t, _ in timed) / len(timed)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq", type=int, default=1024, help="offloading: tokens per row")
    parser.add_argument("--batch", type=int, default=2, help="offloading: rows per step")
    parser.add_argument("--steps", type=int, default=3, help="offloading: optimizer steps")
    parser.add_argument("--part", choices=["offloading"], help=argparse.SUPPRESS)  # packing: bench/train.py
    parser.add_argument("--worker")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.out, args)))
        return

    import torch

    work = Path(tempfile.mkdtemp(prefix="ckptkit-bench-activations-"))
    try:
        params = make_model(work / "model")
        load = os.getloadavg()[0]
        print(f"model: {params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} layers, hidden "
              f"{MODEL['hidden_size']}), float32, LoRA rank 8 on q/k/v/o, device {args.device}; torch "
              f"{torch.__version__}, {os.cpu_count()} CPU cores, load average before {load:.1f}")  # fmt: skip
        offloading(work, args)
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def offloading(work: Path, args: argparse.Namespace) -> None:
    """Peak memory (and tokens/s) with and without checkpointing and offloading."""
    print(f"\noffloading: fixture corpus in chunks of {args.seq} tokens, batch {args.batch}, {args.steps} steps\n")
    peak = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    print(f"| mode | {peak} | vs checkpointing | tokens/s | losses equal to plain |")
    print("| --- | ---: | ---: | ---: | --- |")
    results = {m: measure(m, work / "model", work, args) for m in MODES}
    key = "cuda_peak" if args.device == "cuda" else "peak_rss_mb"
    scale = 1 / 2**20 if args.device == "cuda" else 1.0
    base = results["checkpointing"][key] * scale
    for mode, got in results.items():
        same = got["losses"] == results["plain"]["losses"]
        print(f"| {mode} | {got[key] * scale:.0f} MB | {got[key] * scale - base:+.0f} MB | "
              f"{got['tokens_per_s']:.0f} | {'yes' if same else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    with reporting("activations.py"):
        main()
