"""Rank-0 memory while saving on 2 gloo processes: sharded DCP saves vs the gathered save.

A Llama of about 300M parameters is written by transformers' ``save_pretrained`` (bf16,
several safetensors shards). The model state (bf16 weights + AdamW state, 3 x the weight
bytes) is then saved on 2 ranks, measuring rank 0's RSS just before and its peak during
the save (``VmHWM``, reset before the save), in one run:

- ``gathered (torch full state dict)``: the baseline, what FSDP users do to get one file:
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True,
  cpu_offload=True``, then ``torch.save`` on rank 0;
- ``dcp.save`` and ``dcp.async_save`` (until the write completes) of the sharded state, as
  the trainer calls them (a worker of this script: FSDP2 model, one AdamW step);
- the trainer itself: ``full_finetune_distributed`` (2 steps, a checkpoint after step 1),
  synchronous and with ``checkpointer.async_save: true``, from its ``metrics.jsonl``.

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


def worker(model_dir: Path, out: Path) -> None:
    """Under torchrun: FSDP2 model + AdamW state, then each save; rank 0 prints one JSON line each."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.train import distributed as D
    from ckptkit.train.transformer import build_model

    device, mesh = D.init_distributed("cpu")
    rank = dist.get_rank()
    with open_checkpoint(model_dir) as ckpt:
        model = build_model(ckpt.config, device="meta", dtype=torch.bfloat16)
        D.shard_model(model, mesh, None, None)
        D.load_full_tensors(model, lambda k: ckpt.tensors[k].get(), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW state: exp_avg, exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    group = dist.new_group(backend="gloo")

    def sharded() -> dict:
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}

    def gathered(path: Path) -> None:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=full),
                 "optimizer": get_optimizer_state_dict(model, optimizer, options=full)}  # fmt: skip
        if rank == 0:
            torch.save(state, path / "state.pt")

    def saved_async(path: Path) -> None:
        dcp.async_save(sharded(), checkpoint_id=path, process_group=group).result()

    saves = {
        "gathered (torch full state dict, torch.save on rank 0)": gathered,
        "dcp.save, sharded": lambda path: dcp.save(sharded(), checkpoint_id=path),
        "dcp.async_save, sharded (until written)": saved_async,
    }
    for i, (name, save) in enumerate(saves.items()):
        path = out / f"save{i}"
        path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        D.reset_peak_rss()
        before = D.rss_mib("VmRSS")
        start = time.perf_counter()
        save(path)
        dist.barrier()
        wall, peak = time.perf_counter() - start, D.rss_mib()
        if rank == 0:
            print(json.dumps({"save": name, "before": before, "peak": peak, "wall": wall}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--worker", type=Path, nargs=2, help=argparse.SUPPRESS)  # MODEL OUT, under torchrun
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckptkit-dist-mem-") as tmp:
        root = Path(tmp)
        params = make_model(root / "model", args.hidden, args.layers)
        weights = params * 2 / 2**20
        rows = []
        cmd = torchrun(str(Path(__file__).resolve()), "--worker", str(root / "model"), str(root / "worker"))
        for line in subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                rows.append((r["save"], r["before"], r["peak"], r["wall"]))
        for name, extra in (("trainer, checkpointer.async_save: false", False),
                            ("trainer, checkpointer.async_save: true (staging)", True)):  # fmt: skip
            out = root / f"out{int(extra)}"
            cfg_path = root / f"cfg{int(extra)}.yaml"
            cfg = config(root / "model", out, 1)
            cfg["checkpointer"]["async_save"] = extra
            cfg_path.write_text(yaml.safe_dump(cfg))
            run(torchrun("-m", "ckptkit.train.recipes.full_finetune_distributed", "--config", str(cfg_path)))
            saves = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            mid = next(s for s in saves if "step_" in s.get("checkpoint", ""))
            rows.append((name, mid["rss_mib_before_save"][0], mid["peak_rss_mib_save"][0], mid["save_seconds"]))
        state = 3 * weights
        print(f"1-minute load average: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
              f"({os.cpu_count()} CPUs)")  # fmt: skip
        print(f"model: {params / 1e6:.0f}M parameters; bf16 weights {weights:.0f} MiB, weights + AdamW state "
              f"{state:.0f} MiB (÷ 2 ranks: {state / 2:.0f} MiB)\n")  # fmt: skip
        print("| save (2 gloo ranks) | rank 0 RSS before, MiB | rank 0 peak during, MiB | growth, MiB "
              "| growth / (state ÷ 2) | s |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, before, peak, wall in rows:
            growth = peak - before
            print(f"| {name} | {before:.0f} | {peak:.0f} | {growth:.0f} | {growth / (state / 2):.2f} | {wall:.2f} |")


if __name__ == "__main__":
    with reporting("dist_save_memory.py"):
        main()
