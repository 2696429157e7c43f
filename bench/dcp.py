"""Benchmark DCP -> HF: ``ckptkit convert --to hf`` against torch's ``dcp_to_torch_save`` +
safetensors ``save_file``, on Llama-2-7B-shaped checkpoints.

For each layer count (default 4 and 32, the real 7B) it builds a synthetic HF checkpoint
(``bench/synthetic.py``), converts it to Meta, and saves that as a DCP folder with torch's own
``dcp.save`` from 2 gloo ranks (every 2-D tensor ``Shard(0)`` as FSDP2 shards it, each rank's
half a view of the memory-mapped Meta file; Meta names, Q/K in Meta layout, as torchtitan keeps
them; ``params.json`` beside it). Then it runs ``--repeat`` interleaved rounds (default 3) of:

* ``ckptkit convert D OUT --to hf`` (fsyncs what it publishes);
* the usual route: ``dcp_to_torch_save`` (the whole model into one process's memory, then
  one ``.pt`` file), ``torch.load(mmap=True)`` of it and ``save_file`` of the Meta-named
  tensors as one ``model.safetensors`` (no Q/K permutation or renaming: a floor for that route).

Each command is its own process under GNU ``time`` (``bench/convert.py``'s ``run_child``:
wall, peak RSS, and a watchdog that kills it if available memory falls under 2 GiB),
followed by a timed ``sync``: "until on disk" is command + sync. The source is read once
just before each command (warm cache). Medians over rounds; the ratio is taken per round.
The 1-minute load average is recorded before each command (the machine may be shared).

A layer count runs only if the disk holds the source and both routes' outputs (3 x the
model, plus 2 GiB); the torch route runs only while available memory holds the whole model
plus 2 GiB. What was skipped, and why, is printed.

Run::

    python bench/dcp.py [--layers 4 32] [--repeat 3] [--out bench/out/dcp] [--report docs/bench/dcp.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from convert import MIN_AVAILABLE, Run, loadavg, meminfo, run_child  # noqa: E402
from report import reporting  # noqa: E402

GB = 1 << 30
MiB = 1 << 20
MARGIN = 2 << 30
GOAL = 3.0  # until on disk, the torch route takes at least this many times ckptkit's time
LABELS = {"ckptkit": "ckptkit convert --to hf", "torch": "dcp_to_torch_save + torch.load + save_file"}
TORCH_ROUTE = """
import sys, warnings, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
warnings.simplefilter("ignore")
src, out = sys.argv[1], sys.argv[2]
import os; os.makedirs(out)
dcp_to_torch_save(src, out + "/all.pt")
sd = torch.load(out + "/all.pt", weights_only=True, mmap=True)
save_file({k: v.contiguous() for k, v in sd.items()}, out + "/model.safetensors", metadata={"format": "pt"})
os.unlink(out + "/all.pt")
"""

# Each rank's shard is a view of the memory-mapped Meta file (DCP clones a view before
# writing it, one tensor at a time): building a 13 GB checkpoint needs no 13 GB of memory.
SAVE_RANK = """
import os, sys, warnings, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, Replicate, init_device_mesh
warnings.simplefilter("ignore")
rank, port, meta, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
sd = torch.load(meta + "/consolidated.00.pth", weights_only=True, mmap=True)
state = {}
for k, v in sd.items():
    if k == "rope.freqs":
        continue
    if v.dim() == 2 and v.shape[0] % 2 == 0:
        n = v.shape[0] // 2
        local = v[rank * n : (rank + 1) * n]
        state[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride())
    else:
        state[k] = DTensor.from_local(v, mesh, [Replicate()], run_check=False)
dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
dist.destroy_process_group()
"""


def model_bytes(layers: int) -> tuple[int, int]:
    """(total, largest tensor) bytes of the synthetic model with ``layers`` layers."""
    import math

    from synthetic import shard_plan

    sizes = [math.prod(s) * 2 for shard in shard_plan(layers) for s in shard.values()]
    return sum(sizes), max(sizes)


def ckptkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckptkit", *args, "--quiet"], check=True)


def build(work: Path, layers: int) -> Path:
    """A 2-rank DCP folder of a synthetic Llama-2-7B-shaped model with ``layers`` layers."""
    from synthetic import build_hf

    dcp_dir = work / f"dcp-{layers}"
    if (dcp_dir / ".metadata").is_file() and (dcp_dir / "params.json").is_file():
        return dcp_dir
    hf, meta = work / f"hf-{layers}", work / f"meta-{layers}"
    for p in (hf, meta, dcp_dir):
        shutil.rmtree(p, ignore_errors=True)
    build_hf(hf, layers, seed=0)
    ckptkit("convert", str(hf), str(meta), "--to", "meta")
    shutil.rmtree(hf)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen([sys.executable, "-c", SAVE_RANK, str(r), port, str(meta), str(dcp_dir)]) for r in range(2)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("dcp.save failed")
    shutil.copy(meta / "params.json", dcp_dir / "params.json")
    res = subprocess.run(
        [sys.executable, "-m", "ckptkit", "verify", str(dcp_dir), str(meta)], capture_output=True, text=True
    )
    verdict = res.stdout.splitlines()[0] if res.stdout else res.stderr.strip()
    print(f"{layers} layers: built; ckptkit verify of the DCP folder against the Meta one saved: {verdict}")
    if res.returncode != 0:
        raise SystemExit("the DCP folder does not hold the Meta weights")
    shutil.rmtree(meta)
    os.sync()
    return dcp_dir


def timed(argv: list[str], log: Path) -> Run:
    run, rc = run_child(argv, log)
    if run.skipped is None and rc != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: see {log}")
    start = time.perf_counter()
    os.sync()
    run.sync_s = time.perf_counter() - start
    return run


def until(run: Run) -> float:
    return run.wall_s + (run.sync_s or 0.0)


def warm(src: Path) -> None:
    """Read the source once, untimed, so that every command starts from the same cache."""
    for p in src.iterdir():
        with p.open("rb") as f:
            while f.read(1 << 24):
                pass


def bench_layers(layers: int, args: argparse.Namespace) -> None:
    total, largest = model_bytes(layers)
    src = args.out / f"dcp-{layers}"
    have = sum(p.stat().st_size for p in src.glob("*")) if (src / ".metadata").is_file() else 0
    free = shutil.disk_usage(args.out).free
    need = 3 * total + MARGIN - have  # the source, torch's .pt and both routes' safetensors at most
    if free < need:
        print(f"{layers} layers: skipped: the disk has {free / GB:.1f} GiB free, the source and both routes' "
              f"outputs need {need / GB:.1f} GiB more (3 x {total / GB:.1f} GiB + 2 GiB)\n")  # fmt: skip
        return
    src = build(args.out, layers)
    size = sum(p.stat().st_size for p in src.glob("*.distcp"))
    out = args.out / "out"
    commands = {
        "ckptkit": [sys.executable, "-m", "ckptkit", "convert", str(src), str(out), "--to", "hf", "--quiet"],
        "torch": [sys.executable, "-c", TORCH_ROUTE, str(src), str(out)],
    }
    runs: dict[str, list[Run | None]] = {"ckptkit": [], "torch": []}
    loads: list[float] = []
    print(f"{layers} layers of Llama-2-7B shapes: DCP from 2 gloo ranks (Shard(0)), {size / GB:.2f} GiB in "
          f"2 files; largest tensor {largest / MiB:.0f} MiB")  # fmt: skip
    for r in range(args.repeat):
        order = ["ckptkit", "torch"] if r % 2 == 0 else ["torch", "ckptkit"]
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            available = meminfo()["MemAvailable"]
            if name == "torch" and available < total + MARGIN + MIN_AVAILABLE:
                print(f"  round {r + 1} {LABELS[name]:<44} skipped: {available / GB:.1f} GiB of memory available, "
                      f"it holds the whole model ({total / GB:.1f} GiB) + 4 GiB")  # fmt: skip
                runs[name].append(None)
                continue
            warm(src)
            load = loadavg()
            loads.append(load)
            run = timed(commands[name], args.out / f"{name}-{layers}-{r}.log")
            runs[name].append(None if run.skipped else run)
            what = run.skipped or (
                f"wall {run.wall_s:7.2f} s  +sync {until(run):7.2f} s  peak RSS {run.peak_rss / GB:6.2f} GiB"
            )
            print(f"  round {r + 1} {LABELS[name]:<44} {what}  load {load:.2f}")
    shutil.rmtree(out, ignore_errors=True)
    report(layers, runs, loads, largest)


def report(layers: int, runs: dict[str, list[Run | None]], loads: list[float], largest: int) -> None:
    print(f"\n{layers} layers, medians over the rounds measured:")
    print(f"{'route':<46} {'rounds':>6} {'wall s':>8} {'+sync s':>8} {'peak RSS':>10}")
    for name in ("ckptkit", "torch"):
        done = [x for x in runs[name] if x is not None]
        if not done:
            print(f"{LABELS[name]:<46} {0:>6} {'-':>8} {'-':>8} {'-':>10}")
            continue
        wall = statistics.median(x.wall_s for x in done)
        rss = statistics.median(x.peak_rss for x in done) / GB
        print(f"{LABELS[name]:<46} {len(done):>6} {wall:>8.2f} {statistics.median(map(until, done)):>8.2f} "
              f"{rss:>6.2f} GiB")  # fmt: skip
    pairs = [(c, t) for c, t in zip(runs["ckptkit"], runs["torch"], strict=True) if c and t]
    ratios = [until(t) / until(c) for c, t in pairs]
    if ratios:
        median = statistics.median(ratios)
        verdict = "met" if median >= GOAL else "NOT met"
        print(f"until on disk, torch route / ckptkit per round: {', '.join(f'{x:.2f}x' for x in ratios)}; "
              f"median {median:.2f}x (goal >= {GOAL:.0f}x: {verdict})")  # fmt: skip
    done = [x for x in runs["ckptkit"] if x is not None]
    if done:
        peak = max(x.peak_rss for x in done)
        print(f"ckptkit peak RSS, largest of the rounds: {peak / MiB:.0f} MiB "
              f"(largest tensor {largest / MiB:.0f} MiB)")  # fmt: skip
    if loads:
        print(f"1-minute load average before the commands: min {min(loads):.2f}, median "
              f"{statistics.median(loads):.2f}, max {max(loads):.2f} ({os.cpu_count()} CPUs)")  # fmt: skip
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/dcp"))
    parser.add_argument("--keep", action="store_true", help="keep the built DCP folders for another run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    m = meminfo()
    print(f"machine: {os.cpu_count()} CPUs, {m['MemTotal'] / GB:.1f} GiB memory "
          f"({m['MemAvailable'] / GB:.1f} GiB available at the start), "
          f"{shutil.disk_usage(args.out).free / GB:.0f} GiB free disk\n")  # fmt: skip
    for layers in args.layers:
        bench_layers(layers, args)
        if not args.keep:
            shutil.rmtree(args.out / f"dcp-{layers}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    with reporting("dcp.py"):
        code = main()
    sys.exit(code)
