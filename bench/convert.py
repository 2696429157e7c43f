"""Benchmark ckptkit conversion against ``cp -r`` on a synthetic Llama-2-7B-shaped checkpoint.

What it measures
----------------
For each requested layer count (default 2 and 4) the script

1. builds a synthetic Hugging Face safetensors checkpoint with Llama-2-7B tensor shapes
   (hidden 4096, 32 heads, intermediate 11008, vocab 32000, bf16, random data) but only
   N decoder layers: one shard for the embeddings, one per layer, one for the final norm
   and ``lm_head``, plus ``model.safetensors.index.json`` and a ``config.json`` that
   ckptkit detects as ``llama2`` (rope_theta 10000). Tensors are generated one at a time
   and each shard is written with ``safetensors`` on its own, so building needs about one
   shard of memory (~0.5 GB), not the whole model;
2. runs, each as its own subprocess, and records wall time, CPU time (user + system) and
   peak RSS (``ru_maxrss`` of that process, read with ``wait4`` by a small launcher; see
   ``run_child`` for why not straight from this process):

   * ``cp -r`` of the HF directory (the baseline),
   * ``ckptkit convert --to meta`` (HF -> Meta; this run also makes the Meta copy),
   * ``ckptkit convert --to hf`` of that Meta copy (Meta -> HF),
   * ``ckptkit inspect --json`` of the HF and of the Meta directory,
   * ``python -c "import ckptkit.cli, ckptkit.convert, ckptkit.inspection"``: the floor of every
     ckptkit process (no target; it explains the inspect and RSS numbers);

3. checks the targets: convert wall time <= 2x ``cp -r`` of the same checkpoint; convert
   peak RSS < 2x the largest tensor + 500 MB and about the same (within 10 %) for every
   size; inspect < 1 s. As a correctness check it runs ``ckptkit verify`` on the HF source
   against the Meta -> HF output and compares the weight files byte for byte.

Page cache: dropping it needs CAP_SYS_ADMIN (``/proc/sys/vm/drop_caches``), which a
container usually lacks, so by default every command sees a warm cache: its input is read
once, untimed, just before it runs. ``--cold`` instead evicts the input files with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no privileges needed; on a VM the host may still
cache them). After each command that writes, ``sync`` runs untimed so its dirty pages are
not flushed during the next measurement; the time that ``sync`` took is reported on its own.

The commands run ``--repeat`` times (default 3), interleaved (cp, hf>meta, meta>hf,
inspect, inspect, imports; then again), so that each conversion is compared with a ``cp``
run made under the same machine load: "wall / cp" is the median of those per-round
ratios, and "(wall - floor) / cp" the same after subtracting the round's import-floor
run (roughly the ratio for a checkpoint big enough that start-up no longer counts).
Wall and CPU times are medians, peak RSS the maximum. Sizes are decimal (1 MB = 10^6
bytes). The exit status is 1 only when the round trip is not exact; missed performance
targets are reported, not enforced.

Run::

    python bench/convert.py                    # 2 and 4 layers, temp dir in /tmp, removed after
    python bench/convert.py --layers 2 4 8 --repeat 3 --workdir /tmp/ckb --keep
    python bench/convert.py --json results.json   # also write the raw numbers
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Llama-2-7B
HIDDEN = 4096
HEADS = 32
INTERMEDIATE = 11008
VOCAB = 32000
DTYPE = torch.bfloat16

MB = 1_000_000
RSS_SLACK = 500 * MB  # the target is 2x the largest tensor + this
RSS_FLAT_TOLERANCE = 0.10  # peak RSS "about the same" across sizes: within 10 %
INSPECT_LIMIT_S = 1.0
CONVERT_VS_CP = 2.0


# --- building the synthetic checkpoint -------------------------------------------------


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.v_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def shard_plan(layers: int) -> list[dict[str, tuple[int, ...]]]:
    """Tensor names and shapes per shard: embeddings, one shard per layer, norm + lm_head."""
    shards: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (VOCAB, HIDDEN)}]
    shards += [layer_shapes(i) for i in range(layers)]
    shards.append({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    return shards


def random_tensor(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 data shaped like trained weights: norms near 1, matrices ~N(0, 0.02)."""
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(DTYPE)
    out = torch.empty(shape, dtype=DTYPE)
    rows = max(1, (64 * MB) // (4 * shape[1]))  # fp32 scratch of at most 64 MB
    for start in range(0, shape[0], rows):
        chunk = out[start : start + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=gen).mul_(0.02))
    return out


def config_json(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": HEADS,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def build_hf(root: Path, layers: int, seed: int) -> tuple[int, int]:
    """Write the synthetic checkpoint; returns (total bytes, largest tensor bytes)."""
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shards = shard_plan(layers)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = largest = params = 0
    for i, shapes in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {k: random_tensor(s, gen) for k, s in shapes.items()}
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.nbytes
            params += t.numel()
            largest = max(largest, t.nbytes)
        del tensors
    index = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (root / "config.json").write_text(json.dumps(config_json(layers), indent=2, sort_keys=True) + "\n")
    return total, largest


# --- measuring -------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user + system time of the process
    peak_rss: int  # bytes
    sync_s: float | None = None  # the untimed sync after a command that writes


@dataclass
class Measurement:
    layers: int
    label: str
    argv: list[str]
    runs: list[Run] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def cpu_s(self) -> float:
        return statistics.median(r.cpu_s for r in self.runs)

    @property
    def peak_rss(self) -> int:
        return max(r.peak_rss for r in self.runs)

    @property
    def sync_s(self) -> float | None:
        syncs = [r.sync_s for r in self.runs if r.sync_s is not None]
        return statistics.median(syncs) if syncs else None


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def warm(paths: list[Path]) -> None:
    """Read every file once so the timed command finds it in the page cache."""
    buf = bytearray(16 << 20)
    for root in paths:
        for p in files_under(root):
            with p.open("rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def evict(paths: list[Path]) -> None:
    """Drop the (clean) cached pages of these files; needs no privileges."""
    for root in paths:
        for p in files_under(root):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w"):
            return True
    except OSError:
        return False


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# A child's ru_maxrss is not its own peak when the parent is big: Popen starts it with
# vfork(), so the child shares the parent's address space until exec, and exec records
# that address space's high-water mark in the child's maxrss (measured here: `true` run
# from an 830 MB Python parent reports 830 MB through os.wait4). So every command runs
# under a tiny launcher, and the numbers come from the launcher's wait4 on its own
# child: GNU time where installed, otherwise this Python snippet (whose ~10 MB then
# becomes the floor of every RSS reading).
TIME = "/usr/bin/time"
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{ru.ru_maxrss} {ru.ru_utime} {ru.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_child(argv: list[str], log: Path) -> tuple[Run, int]:
    """Run argv with stdout and stderr to ``log``; its numbers and exit status."""
    stats = log.with_suffix(".rusage")
    if os.access(TIME, os.X_OK):
        wrapped = [TIME, "-f", "%M %U %S", "-o", str(stats), *argv]
    else:
        wrapped = [sys.executable, "-S", "-c", LAUNCHER, str(stats), *argv]
    with log.open("wb") as out:
        start = time.perf_counter()
        rc = subprocess.run(wrapped, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - start
    # GNU time puts "Command exited with non-zero status N" on a line of its own first.
    last = stats.read_text().strip().splitlines()[-1].split() if stats.exists() else ["0", "0", "0"]
    kib, user, system = int(last[0]), float(last[1]), float(last[2])
    return Run(wall, user + system, kib * 1024), rc  # ru_maxrss is in KiB on Linux


class Bench:
    def __init__(self, workdir: Path, repeat: int, cold: bool, ckptkit: list[str]):
        self.workdir, self.repeat, self.cold, self.ckptkit = workdir, repeat, cold, ckptkit
        self.results: dict[tuple[int, str], Measurement] = {}
        self.loads: list[float] = []

    def measure(self, layers: int, label: str, argv: list[str], inputs: list[Path], output: Path | None = None) -> Run:
        """One timed run of argv; ``output`` is removed first and synced after."""
        m = self.results.setdefault((layers, label), Measurement(layers, label, argv))
        if output is not None and output.exists():
            shutil.rmtree(output)
        os.sync()
        (evict if self.cold else warm)(inputs)
        self.loads.append(loadavg())
        slug = "".join(c if c.isalnum() else "_" for c in label)
        log = self.workdir / f"log-{layers}L-{slug}-{len(m.runs)}.txt"
        run, rc = run_child(argv, log)
        if rc != 0:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise SystemExit(f"{' '.join(argv)} exited with {rc} (log: {log})")
        if output is not None:
            t = time.perf_counter()
            os.sync()
            run.sync_s = time.perf_counter() - t
        m.runs.append(run)
        print(
            f"  {layers}L  {label:<24} wall {run.wall_s:6.2f} s  cpu {run.cpu_s:6.2f} s  "
            f"peak RSS {run.peak_rss / MB:6.0f} MB  (load {self.loads[-1]:.1f})",
            flush=True,
        )
        return run


# --- reporting -------------------------------------------------------------------------


def machine() -> dict[str, str]:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem = next((ln.split()[1] for ln in meminfo if ln.startswith("MemTotal")), "0")
    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        platform.machine(),
    )
    import safetensors

    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "ram": f"{int(mem) / 1024**2:.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }


def verdict(ok: bool) -> str:
    return "pass" if ok else "**FAIL**"


CONVERTS = ("convert hf>meta", "convert meta>hf")


def ratio_to_cp(bench: Bench, layers: int, label: str, less_floor: bool = False) -> float:
    """Median over rounds of wall / the wall of that round's cp run.

    With ``less_floor`` the round's import-floor run is subtracted first: what is left is
    the part of a conversion that grows with the checkpoint, so this ratio is roughly
    what the ratio becomes for a checkpoint large enough that the ~1 s of interpreter and
    torch start-up no longer matters (an estimate, and a conservative one: other fixed
    costs stay in).
    """
    runs, cps = bench.results[(layers, label)].runs, bench.results[(layers, "cp -r")].runs
    floors = bench.results[(layers, "import floor")].runs if less_floor else [Run(0.0, 0.0, 0)] * len(runs)
    return statistics.median((r.wall_s - f.wall_s) / c.wall_s for r, c, f in zip(runs, cps, floors, strict=True))


def report(
    bench: Bench, sizes: dict[int, tuple[int, int]], checks: dict[int, tuple[bool, bool]], argv: list[str]
) -> tuple[str, dict[str, Any]]:
    largest = max(lg for _, lg in sizes.values())
    rss_limit = 2 * largest + RSS_SLACK
    cache = "cold (inputs evicted with posix_fadvise)" if bench.cold else "warm (inputs read just before each run)"
    lines = [
        f"command: `{' '.join(argv)}`",
        "",
        f"page cache {cache}; {bench.repeat} interleaved repetition(s): wall and CPU are medians, "
        f"peak RSS the maximum; load average {min(bench.loads):.1f}-{max(bench.loads):.1f} on "
        f"{os.cpu_count()} cores during the runs. Largest tensor {largest / MB:.0f} MB, so the RSS "
        f"limit is 2 x {largest / MB:.0f} + 500 = {rss_limit / MB:.0f} MB.",
        "",
        "| layers | size | command | wall s (min-max) | CPU s | wall / cp | (wall - floor) / cp "
        "| peak RSS MB | sync s | target | result |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    targets: list[tuple[str, bool]] = []
    for layers, (total, _) in sizes.items():
        for (n, label), m in bench.results.items():
            if n != layers:
                continue
            ratio = ratio_to_cp(bench, layers, label)
            target = res = ""
            if label in CONVERTS:
                ok_t, ok_m = ratio <= CONVERT_VS_CP, m.peak_rss < rss_limit
                target = f"<= {CONVERT_VS_CP:g}x cp, < {rss_limit / MB:.0f} MB"
                res = f"time {verdict(ok_t)}, RSS {verdict(ok_m)}"
                targets += [
                    (f"{label} {layers}L: wall <= {CONVERT_VS_CP:g}x cp -r ({ratio:.1f}x)", ok_t),
                    (f"{label} {layers}L: peak RSS < {rss_limit / MB:.0f} MB ({m.peak_rss / MB:.0f} MB)", ok_m),
                ]
            elif label.startswith("inspect"):
                ok = m.wall_s < INSPECT_LIMIT_S
                target, res = f"< {INSPECT_LIMIT_S:g} s", verdict(ok)
                targets.append((f"{label} {layers}L: < {INSPECT_LIMIT_S:g} s ({m.wall_s:.2f} s)", ok))
            walls = [r.wall_s for r in m.runs]
            spread = f" ({min(walls):.2f}-{max(walls):.2f})" if len(walls) > 1 else ""
            sync = f"{m.sync_s:.2f}" if m.sync_s is not None else ""
            net = f"{ratio_to_cp(bench, layers, label, less_floor=True):.2f}" if label in CONVERTS else ""
            lines.append(
                f"| {layers} | {total / MB:,.0f} MB | {label} | {m.wall_s:.2f}{spread} | {m.cpu_s:.2f} | "
                f"{ratio:.2f} | {net} | {m.peak_rss / MB:,.0f} | {sync} | {target} | {res} |"
            )
    layer_counts = sorted(sizes)
    for label in CONVERTS:
        rss = [bench.results[(n, label)].peak_rss for n in layer_counts]
        flat = max(rss) <= min(rss) * (1 + RSS_FLAT_TOLERANCE)
        spread = ", ".join(f"{n}L {r / MB:.0f} MB" for n, r in zip(layer_counts, rss, strict=True))
        targets.append((f"{label}: peak RSS flat across sizes, within 10 % ({spread})", flat))
    for layers, (verified, identical) in checks.items():
        targets.append(
            (f"{layers}L round trip: `ckptkit verify` of the HF source against the meta>hf output", verified)
        )
        targets.append((f"{layers}L round trip: meta>hf weight files byte-identical to the source", identical))
    lines += ["", "| check | result |", "|---|---|", *(f"| {name} | {verdict(ok)} |" for name, ok in targets)]
    raw = {
        "machine": machine(),
        "argv": argv,
        "cold": bench.cold,
        "repeat": bench.repeat,
        "load_average": [min(bench.loads), max(bench.loads)],
        "sizes": {str(k): {"total_bytes": t, "largest_tensor_bytes": lg} for k, (t, lg) in sizes.items()},
        "rss_limit_bytes": rss_limit,
        "measurements": [
            asdict(m) | {"wall_s": m.wall_s, "cpu_s": m.cpu_s, "peak_rss": m.peak_rss} for m in bench.results.values()
        ],
        "targets": dict(targets),
    }
    return "\n".join(lines), raw


# --- main ------------------------------------------------------------------------------


def weights_identical(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors")
    other = sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors")
    return names == other and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def bench_size(bench: Bench, layers: int, seed: int) -> tuple[tuple[int, int], tuple[bool, bool]]:
    base = bench.workdir / f"{layers}L"
    hf, meta, back, copy = base / "hf", base / "meta", base / "hf-roundtrip", base / "hf-copy"
    if base.exists():
        shutil.rmtree(base)
    t = time.perf_counter()
    total, largest = build_hf(hf, layers, seed)
    took = time.perf_counter() - t
    print(f"{layers} layers: built {total / MB:,.0f} MB of HF safetensors in {took:.1f} s", flush=True)
    ck = bench.ckptkit
    imports = [sys.executable, "-c", "import ckptkit.cli, ckptkit.convert, ckptkit.inspection"]
    for _ in range(bench.repeat):  # interleaved, so each convert run has a cp run beside it
        bench.measure(layers, "cp -r", ["cp", "-r", str(hf), str(copy)], [hf], copy)
        shutil.rmtree(copy)
        bench.measure(
            layers, "convert hf>meta", [*ck, "convert", str(hf), str(meta), "--to", "meta", "--quiet"], [hf], meta
        )
        bench.measure(
            layers, "convert meta>hf", [*ck, "convert", str(meta), str(back), "--to", "hf", "--quiet"], [meta], back
        )
        bench.measure(layers, "inspect hf", [*ck, "inspect", str(hf), "--json"], [hf])
        bench.measure(layers, "inspect meta", [*ck, "inspect", str(meta), "--json"], [meta])
        bench.measure(layers, "import floor", imports, [])
    verify = subprocess.run([*ck, "verify", str(hf), str(back)], capture_output=True, text=True)
    said = (verify.stdout.strip() or verify.stderr.strip() or "(no output)").splitlines()[-1]
    print(f"  verify: {said}", flush=True)
    identical = weights_identical(hf, back)
    return (total, largest), (verify.returncode == 0, identical)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="decoder layer counts (default: 2 4)")
    ap.add_argument("--workdir", type=Path, help="where checkpoints go (default: a new directory in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of every command (default 3)")
    ap.add_argument("--cold", action="store_true", help="evict inputs from the page cache before each run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeat < 1 or any(n < 1 for n in args.layers):
        raise SystemExit("--repeat and --layers must be positive")
    made = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ckptkit-bench-", dir="/tmp")) if made else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(workdir.resolve(), args.repeat, args.cold, [sys.executable, "-m", "ckptkit"])
    print(" | ".join(f"{k} {v}" for k, v in machine().items()), flush=True)
    if not args.cold:
        # Even where permitted, drop_caches empties the cache of every process on the machine.
        why = "permitted here but not used" if can_drop_caches() else "not permitted here"
        print(f"dropping the page cache is {why}: every run sees a warm cache", flush=True)
    sizes: dict[int, tuple[int, int]] = {}
    checks: dict[int, tuple[bool, bool]] = {}
    try:
        for layers in args.layers:
            sizes[layers], checks[layers] = bench_size(bench, layers, args.seed)
            if not args.keep:
                shutil.rmtree(bench.workdir / f"{layers}L")
    finally:
        if not args.keep:
            for layers in args.layers:
                shutil.rmtree(bench.workdir / f"{layers}L", ignore_errors=True)
            if made:
                shutil.rmtree(workdir, ignore_errors=True)
    shown = ["python", "bench/convert.py", *(argv if argv is not None else sys.argv[1:])]
    table, raw = report(bench, sizes, checks, shown)
    print()
    print(table)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    # Performance targets are reported, not enforced (timings on a shared machine vary);
    # a failed round trip is an error.
    return 0 if all(ok for (verified, identical) in checks.values() for ok in (verified, identical)) else 1


if __name__ == "__main__":
    sys.exit(main())
