"""QLoRA vs LoRA: peak memory and tokens/s of training steps on Llama-3-8B-shaped decoder layers.

The native model with ``--layers`` decoder layers of Llama 3.1 8B's shapes (hidden 4096, MLP
14336, 32 heads, 8 KV heads; ``--scale 4`` divides hidden, MLP and heads by 4 for a CPU),
a vocabulary of 384, bf16 weights, LoRA rank 16 on q, k, v, o, gate, up, down with float32
adapters (ckptkit's defaults). QLoRA keeps the decoder linears in torchao's NF4
(:mod:`ckptkit.train.nf4`). Each mode runs in its own subprocess: peak memory is the
process's peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA; tokens/s is the
median of the timed AdamW steps after one warm-up step.

    python bench/qlora.py --scale 4 --layers 2                      # CPU
    python bench/qlora.py --device cuda --scale 1 --layers 4 --seq 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import reporting

REPO = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from ckptkit import open_checkpoint
    from ckptkit.train import nf4
    from ckptkit.train.lora import apply_lora
    from ckptkit.train.transformer import build_model

    with open_checkpoint(REPO / "fixtures" / "hf" / "llama3") as ckpt:
        base = ckpt.config
    s = args.scale
    cfg = dataclasses.replace(
        base, hidden_size=4096 // s, intermediate_size=14336 // s, num_heads=32 // s, num_kv_heads=8 // s,
        head_dim=128, num_layers=args.layers,
    )  # fmt: skip
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16)
    apply_lora(model, targets=["q", "k", "v", "o", "gate", "up", "down"], rank=16, alpha=32)
    if args.mode == "qlora":  # quantized on the device, one weight at a time (as the recipe does)
        for name in nf4.quantized_linears(model):
            m = model.get_submodule(name)
            m.weight = torch.nn.Parameter(nf4.to_nf4(m.weight.to(device)), requires_grad=False)
    model.to(device)
    frozen = sum(_nbytes(p) for p in model.parameters() if not p.requires_grad) / 2**30
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for step in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            rates.append(args.batch * (args.seq - 1) / (time.perf_counter() - t0))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"frozen_gib": frozen, "peak_gib": peak, "tokens_per_s": statistics.median(rates), "loss": float(loss)}


def _nbytes(tensor: Any) -> int:
    """Bytes a parameter holds: an NF4 tensor's codes, quantized scales and their factors."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None and type(tensor).__name__ == "NF4Tensor":
        return sum(getattr(tensor, name).nbytes for name in inner()[0])
    return int(tensor.nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scale", type=int, default=1, help="divide hidden, MLP and heads by this")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", choices=["lora", "qlora"], help=argparse.SUPPRESS)  # the worker
    if "--mode" in sys.argv:  # a worker: one mode, its figures as one JSON line
        print(json.dumps(worker(parser.parse_args())))
        return
    with reporting("qlora.py"):  # takes --report out of sys.argv
        args = parser.parse_args()
        results = {}
        for mode in ("lora", "qlora"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
        import torch

        hidden = 4096 // args.scale
        print(
            f"{args.layers} decoder layers, hidden {hidden}, MLP {14336 // args.scale}, bf16 base, LoRA rank 16 "
            f"on all seven projections (float32 adapters); batch {args.batch} x seq {args.seq}, median of "
            f"{args.steps} steps after one warm-up; device {args.device}, torch {torch.__version__}\n"
        )
        peak = "peak GPU memory allocated" if args.device.startswith("cuda") else "peak RSS"
        print(f"| mode | frozen weights (GiB) | {peak} (GiB) | tokens/s | last loss |\n|---|---|---|---|---|")
        for mode, r in results.items():
            print(
                f"| {mode} | {r['frozen_gib']:.3f} | {r['peak_gib']:.2f} | {r['tokens_per_s']:.1f} | {r['loss']:.4f} |"
            )
        q, b = results["qlora"], results["lora"]
        ratios = {k: q[k] / b[k] for k in ("frozen_gib", "peak_gib", "tokens_per_s")}
        print("\nQLoRA / LoRA: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
