"""AdamW step time on CPU: the for-loop, for-each and fused implementations of torch.optim.AdamW.

Parameters shaped like bench/train.py's 18M-parameter Llama (float32), random gradients.
Rounds interleave the three implementations, so every ratio compares steps taken under
the same load; the table shows the median step time over rounds.

    python bench/optimizer.py --rounds 7 --steps 10
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
from report import reporting

SHAPES = [(384, 512), (384, 512)] + [(512, 512), (256, 512), (256, 512), (512, 512)] * 6
SHAPES += [(1408, 512), (1408, 512), (512, 1408)] * 6 + [(512,)] * 13
KINDS = {"for-loop": {"foreach": False}, "for-each": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizers = {k: torch.optim.AdamW(params, lr=1e-4, **kw) for k, kw in KINDS.items()}
    for opt in optimizers.values():
        opt.step()  # allocate the state
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        order = list(KINDS)[r % 3 :] + list(KINDS)[: r % 3]
        for kind in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizers[kind].step()
            times[kind].append((time.perf_counter() - start) / args.steps * 1000)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    n = sum(p.numel() for p in params)
    print(f"{n / 1e6:.1f}M float32 parameters, {args.rounds} interleaved rounds of {args.steps} steps; "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"process: user {usage.ru_utime:.1f} s, sys {usage.ru_stime:.1f} s, peak RSS {usage.ru_maxrss / 1024:.0f} MB")
    print()
    print("| AdamW | ms/step (median) | per round | for-loop / this (median of rounds) |")
    print("| --- | ---: | --- | ---: |")
    for kind, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(times["for-loop"], values, strict=True))
        print(f"| {kind} | {statistics.median(values):.1f} | {' / '.join(f'{v:.0f}' for v in values)} | {ratio:.2f}x |")


if __name__ == "__main__":
    with reporting("optimizer.py"):
        main()
