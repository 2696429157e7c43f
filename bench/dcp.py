"""Benchmark DCP -> HF: ``ckptkit convert --to hf`` against torch's ``dcp_to_torch_save`` +
safetensors ``save_file``, on Llama-2-7B-shaped checkpoints.

For each layer count (default 4) it builds a synthetic HF checkpoint (``bench/synthetic.py``),
saves it as a DCP folder with torch's own ``dcp.save`` from 2 gloo ranks (every 2-D tensor
``Shard(0)`` as FSDP2 shards it; Meta names, Q/K in Meta layout, as torchtitan keeps them;
``params.json`` beside it), and then runs ``--repeat`` interleaved rounds (default 3) of:

* ``ckptkit convert D OUT --to hf`` (fsyncs what it publishes);
* the usual route: ``dcp_to_torch_save`` (the whole model into one process's memory, then
  one ``.pt`` file), ``torch.load`` of it and ``save_file`` of the Meta-named tensors as one
  ``model.safetensors`` (no Q/K permutation or renaming: a floor for that route).

Each command is its own process under GNU ``time`` (``bench/convert.py``'s ``run_child``:
wall, peak RSS), followed by a timed ``sync``: "until on disk" is command + sync. Medians
over rounds; the ratio is taken per round.

Run::

    python bench/dcp.py [--layers 4] [--repeat 3] [--out bench/out/dcp] [--report docs/bench/dcp.md]
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

from convert import Run, run_child  # noqa: E402
from report import reporting  # noqa: E402

GB = 1 << 30
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

SAVE_RANK = """
import os, sys, warnings, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, Replicate, distribute_tensor, init_device_mesh
warnings.simplefilter("ignore")
rank, port, meta, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
sd = torch.load(meta + "/consolidated.00.pth", weights_only=True, mmap=True)
state = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() == 2 else Replicate()]) for k, v in sd.items()
         if k != "rope.freqs"}
dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
dist.destroy_process_group()
"""


def ckptkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckptkit", *args, "--quiet"], check=True)


def build(work: Path, layers: int) -> Path:
    """A 2-rank DCP folder of a synthetic Llama-2-7B-shaped model with ``layers`` layers."""
    from synthetic import build_hf

    dcp_dir = work / f"dcp-{layers}"
    if (dcp_dir / ".metadata").is_file():
        return dcp_dir
    hf, meta = work / f"hf-{layers}", work / f"meta-{layers}"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(meta, ignore_errors=True)
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
    shutil.rmtree(meta)
    return dcp_dir


def timed(argv: list[str], log: Path) -> Run:
    run, rc = run_child(argv, log)
    if rc != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: see {log}")
    start = time.perf_counter()
    os.sync()
    run.sync_s = time.perf_counter() - start
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/dcp"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for layers in args.layers:
        src = build(args.out, layers)
        size = sum(p.stat().st_size for p in src.glob("*.distcp"))
        runs: dict[str, list[Run]] = {"ckptkit": [], "torch": []}
        commands = {
            "ckptkit": [
                sys.executable,
                "-m",
                "ckptkit",
                "convert",
                str(src),
                str(args.out / "out"),
                "--to",
                "hf",
                "--quiet",
            ],
            "torch": [sys.executable, "-c", TORCH_ROUTE, str(src), str(args.out / "out")],
        }
        for r in range(args.repeat):
            order = ["ckptkit", "torch"] if r % 2 == 0 else ["torch", "ckptkit"]
            for name in order:
                shutil.rmtree(args.out / "out", ignore_errors=True)
                os.sync()
                for p in src.iterdir():  # warm: read the source once, untimed
                    with p.open("rb") as f:
                        while f.read(1 << 24):
                            pass
                runs[name].append(timed(commands[name], args.out / f"{name}-{r}.log"))
        shutil.rmtree(args.out / "out", ignore_errors=True)

        def med(name: str, attr: str, runs: dict[str, list[Run]] = runs) -> float:
            return statistics.median(getattr(x, attr) for x in runs[name])

        print(
            f"{layers} layers of Llama-2-7B shapes: DCP from 2 gloo ranks (Shard(0)), {size / GB:.2f} GiB; "
            f"{args.repeat} rounds, medians"
        )
        print(f"{'route':<46} {'wall s':>8} {'+sync s':>8} {'peak RSS':>10}")
        labels = {"ckptkit": "ckptkit convert --to hf", "torch": "dcp_to_torch_save + torch.load + save_file"}
        for name in ("ckptkit", "torch"):
            until = statistics.median(x.wall_s + (x.sync_s or 0) for x in runs[name])
            rss = med(name, "peak_rss") / GB
            print(f"{labels[name]:<46} {med(name, 'wall_s'):>8.2f} {until:>8.2f} {rss:>8.2f} GiB")
        ratios = [
            (t.wall_s + (t.sync_s or 0)) / (c.wall_s + (c.sync_s or 0))
            for c, t in zip(runs["ckptkit"], runs["torch"], strict=True)
        ]
        print(
            f"until on disk, torch route / ckptkit per round: {', '.join(f'{x:.2f}x' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f}x"
        )
    return 0


if __name__ == "__main__":
    with reporting("dcp.py"):
        code = main()
    sys.exit(code)
