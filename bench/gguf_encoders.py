"""Benchmark ckptkit's GGML block encoders (``ckptkit/formats/gguf/encoders``): MB/s of float32
input per type on one tensor (default 4096 x 4096, ``N(0, 0.02)``), on one thread (CPU time,
which a shared machine's load does not inflate) and through ``encode_blocks`` (the thread pool
the streamed GGUF write uses; wall time).

Run from a checkout (``PYTHONPATH`` picks the ckptkit measured)::

    python bench/gguf_encoders.py [--rows 4096] [--cols 4096] [--types Q4_K Q6_K]
        [--report docs/bench/gguf_encoders.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import reporting  # noqa: E402

# This script's folder holds bench/gguf.py: without it on the path, ``import gguf`` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from ckptkit.formats.gguf import quants  # noqa: E402
from ckptkit.formats.gguf.encoders import ENCODERS  # noqa: E402


def measure(kind: str, x: np.ndarray) -> tuple[float, float]:
    """(MB/s on one thread by CPU time, MB/s through the pool by wall time) for ``kind``."""
    enc, step = ENCODERS[kind], quants.ENCODE_BLOCKS
    flat = x.reshape(-1)
    start = time.thread_time()
    with np.errstate(all="ignore"):
        for first in range(0, flat.size, step):
            enc.encode(flat[first : first + step])
    one = x.nbytes / (time.thread_time() - start) / 1e6
    start = time.perf_counter()
    quants.encode_blocks(kind, x)
    pooled = x.nbytes / (time.perf_counter() - start) / 1e6
    return one, pooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--types", nargs="*", default=list(ENCODERS))
    args = parser.parse_args()
    x = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    print(f"{args.rows} x {args.cols} float32, {len(quants._WORKERS) + 1} threads")
    print("| type | MB/s, 1 thread (CPU time) | MB/s, pool (wall) |")
    print("|---|---:|---:|")
    for kind in args.types:
        one, pooled = measure(kind, x)
        print(f"| {kind} | {one:.1f} | {pooled:.1f} |", flush=True)


if __name__ == "__main__":
    with reporting("gguf_encoders.py"):
        main()
