"""Benchmark ckptkit conversion against ``cp -r`` and torchtune on Llama-2-7B-shaped checkpoints.

What it measures
----------------
For each layer count (default 4; ``--layers 4 32`` for the real 7B size, 13.5 GB) it
builds a synthetic HF safetensors checkpoint (``bench/synthetic.py``: Llama-2-7B shapes,
bf16, random data) and then runs ``--repeat`` interleaved rounds (default 3) of:

* ``cp -r`` of the HF directory, ``ckptkit convert --to meta`` of it (hf>meta);
* ``cp -r`` of that Meta directory, ``ckptkit convert --to hf`` of it (meta>hf);
* torchtune's Meta load + save of the Meta directory (``bench/torchtune_roundtrip.py``);
* ``ckptkit convert --to internal`` of the HF directory (hf>internal) and a second
  ``cp -r`` of it; none of the three conversions imports torch (Llama 2's
  ``rope.freqs`` is computed without it);
* torchtune's HF load + save of the HF directory;
* the import floors: ``python -c "import ckptkit.cli, ckptkit.convert"`` (what a
  torch-free conversion pays) and the same plus ``import torch``;
* ``dd`` of the Meta weight file with ``oflag=direct conv=fsync`` (the **durable copy**):
  the same bytes copied with nothing else done, past the page cache and flushed, so
  on disk when it exits, as ckptkit's output is: what the simplest writer that keeps
  ckptkit's guarantee (a published checkpoint survives a crash) pays for the disk in
  that round. It is one stream, not a floor (two writers on different files can beat
  it), but where it misses a target, a durable writer meets it only by beating a plain
  copy of the same bytes;
* with ``--buffered-too``, meta>hf again with ``--copy-method stream`` (every write
  through the page cache, as ``auto`` does for outputs under the kernel's dirty limit),
  to compare with ``auto``'s direct writes in the same rounds;
* with ``--baseline DIR`` (another checkout of ckptkit, e.g. ``git worktree add
  /tmp/base COMMIT``), the three conversions (and the buffered one) again with that
  code (``PYTHONPATH=DIR``), labelled ``(baseline)``, in the same rounds: a before/after
  comparison under the same conditions, with its own table of per-round ratios.

Every command is its own process under GNU ``time`` (wall, user, sys, peak RSS; a
launcher is needed because a child started from a big Python parent inherits its
high-water mark). Inputs are read once, untimed, just before each command (warm cache;
``--cold`` evicts them instead) and every writer is followed by a ``sync``, timed apart:
ckptkit fsyncs what it publishes (so its ``sync`` finds little left), ``cp`` does not, so
the tables give both ratios, the command alone and the command plus its ``sync`` (until
the output is on disk).
Fairness: on the development VM, memory the guest frees is handed back to the host
after a while, and a process that then fills fresh page cache pays for the host taking
it back: a ``cp -r`` of 2 GB took 0.7 s, or 2.5 s right after another process freed
2.8 GB. So every command starts after the same ``--settle`` wait (default 5 s) following
the removal of the previous output, a ``sync`` and the warm-up read, and each
conversion and the ``cp -r`` of its input swap order every round (the last round runs
``cp`` first, so the verified meta>hf output is the last thing written).
Ratios are taken per round, against the ``cp -r`` of the same bytes and the torchtune run
on the same source in the same round; the tables give each round's ratio and the median.
The last round's meta>hf output is checked with ``ckptkit verify`` and a byte comparison
with the source.

Resources: at most three copies of the checkpoint exist at once (source, Meta copy, one
output), each output is deleted after its run. torchtune's HF load holds the whole state
dict in memory: it only runs when the machine's memory in use would stay under
``--mem-limit-gb`` (default 20), and a watchdog kills any command if available memory
falls under 2 GB (reported as skipped or killed, never as a number).

Run::

    python bench/convert.py                              # 4 layers, 3 rounds, in bench/out
    python bench/convert.py --layers 4 32 --json bench/out/results.json
    python bench/convert.py --baseline /tmp/base --buffered-too --no-torchtune
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from report import reporting
from synthetic import MB, build_hf

HERE = Path(__file__).resolve().parent
CP_LIMIT = 1.2  # target: a conversion takes at most this times cp -r of the same bytes
TORCHTUNE_FACTOR = 4.0  # target: at least this many times faster than torchtune's load + save
RSS_FLAT = 0.10  # peak RSS "the same" at every size: within 10 %
MIN_AVAILABLE = 2 << 30  # the watchdog kills a command when MemAvailable drops below this
GB = 1 << 30
FLOOR_TORCH, FLOOR_FREE = "import floor (torch)", "import floor (no torch)"
# conversion -> (the cp of its input, the torchtune run on the same source, its import floor)
PEERS = {
    "convert hf>meta": ("cp -r hf", "torchtune hf load+save", FLOOR_FREE),  # torch-free since rope.freqs
    "convert meta>hf": ("cp -r meta", "torchtune meta load+save", FLOOR_FREE),
    "convert hf>internal": ("cp -r hf (2)", "torchtune hf load+save", FLOOR_FREE),
}
# with --buffered-too: meta>hf written through the page cache, as before direct writes (no target)
BUFFERED = "convert meta>hf --copy-method stream"
# every round: the Meta weight file copied with dd, O_DIRECT, fsync: the durable copy (no target)
DURABLE = "dd meta (direct + fsync)"
VARIANTS = {BUFFERED: PEERS["convert meta>hf"], DURABLE: PEERS["convert meta>hf"]}
# with --baseline: each conversion again with the baseline's code (no target)
BASELINE = " (baseline)"
VARIANTS |= {label + BASELINE: peers for label, peers in (*PEERS.items(), (BUFFERED, VARIANTS[BUFFERED]))}


@dataclass
class Run:
    wall_s: float
    user_s: float
    sys_s: float
    peak_rss: int  # bytes
    sync_s: float | None = None
    skipped: str | None = None  # why there is no measurement


@dataclass
class Measurement:
    layers: int
    label: str
    runs: list[Run] = field(default_factory=list)

    def done(self) -> list[Run]:
        return [r for r in self.runs if r.skipped is None]

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.done()]
        return statistics.median(values) if values else None


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


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def memory_in_use() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_child(argv: list[str], log: Path) -> tuple[Run, int]:
    """Run argv under GNU time (stdout and stderr to ``log``), killed if memory runs out."""
    stats = log.with_suffix(".rusage")
    wrapped = ["/usr/bin/time", "-f", "%M %U %S", "-o", str(stats), *argv]
    killed = None
    with log.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(
            wrapped, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        while True:
            try:
                proc.wait(timeout=0.05)  # returns as the child ends: the wall time is not rounded up to a poll
                break
            except subprocess.TimeoutExpired:
                pass
            if meminfo()["MemAvailable"] < MIN_AVAILABLE and killed is None:
                killed = f"killed by the memory watchdog (MemAvailable < {MIN_AVAILABLE / GB:.0f} GiB)"
                os.killpg(proc.pid, signal.SIGKILL)
        wall = time.perf_counter() - start
    # GNU time puts "Command exited with non-zero status N" on a line of its own first.
    last = stats.read_text().strip().splitlines()[-1].split() if stats.exists() else ["0", "0", "0"]
    run = Run(wall, float(last[1]), float(last[2]), int(last[0]) * 1024, skipped=killed)
    return run, proc.returncode


def timed(argv: list[str], log: Path, cwd: Path | None = None) -> Run:
    """``argv`` (run in ``cwd``) under GNU time, then a timed ``sync``: until on disk."""
    here = Path.cwd()
    os.chdir(cwd or here)
    try:
        run, rc = run_child(argv, log)
    finally:
        os.chdir(here)
    if rc != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: see {log}")
    start = time.perf_counter()
    os.sync()
    run.sync_s = time.perf_counter() - start
    return run


class Bench:
    def __init__(
        self,
        workdir: Path,
        repeat: int,
        cold: bool,
        mem_limit: int,
        settle: float = 5.0,
        buffered_too: bool = False,
        baseline: Path | None = None,
    ):
        self.workdir, self.repeat, self.cold, self.mem_limit = workdir, repeat, cold, mem_limit
        self.settle, self.buffered_too, self.baseline = settle, buffered_too, baseline
        self.results: dict[tuple[int, str], Measurement] = {}
        self.loads: list[float] = []
        self.ckptkit = [sys.executable, "-m", "ckptkit"]
        # env execs python in the same process, so GNU time still measures python
        self.ckptkit_baseline = ["env", f"PYTHONPATH={baseline}", *self.ckptkit] if baseline else []

    def measure(
        self, layers: int, label: str, argv: list[str], inputs: list[Path], output: Path | None = None, need: int = 0
    ) -> Run:
        """One timed run; ``output`` is removed first and synced after. ``need``: the memory
        the command will hold; it is skipped if that would take the machine past the limit."""
        m = self.results.setdefault((layers, label), Measurement(layers, label))
        if output is not None:
            remove(output)
        os.sync()
        in_use = memory_in_use()
        if need and in_use + need > self.mem_limit:
            why = f"skipped: {in_use / GB:.1f} GiB in use + {need / GB:.1f} GiB needed > {self.mem_limit / GB:.0f} GiB"
            m.runs.append(Run(0, 0, 0, 0, skipped=why))
            print(f"  {layers}L  {label:<26} {why}", flush=True)
            return m.runs[-1]
        (evict if self.cold else warm)(inputs)
        time.sleep(self.settle)  # every command starts from the same state (see "Fairness" above)
        self.loads.append(loadavg())
        slug = "".join(c if c.isalnum() else "_" for c in label)
        log = self.workdir / f"log-{layers}L-{slug}-{len(m.runs)}.txt"
        run, rc = run_child(argv, log)
        if rc != 0 and run.skipped is None:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise SystemExit(f"{' '.join(argv)} exited with {rc} (log: {log})")
        if output is not None:
            t = time.perf_counter()
            os.sync()
            run.sync_s = time.perf_counter() - t
            if run.skipped:
                remove(output)
        m.runs.append(run)
        print(
            f"  {layers}L  {label:<26} wall {run.wall_s:7.2f} s  user {run.user_s:6.2f}  sys {run.sys_s:6.2f}  "
            f"RSS {run.peak_rss / MB:6.0f} MB  sync {run.sync_s or 0:5.2f} s  load {self.loads[-1]:4.1f}"
            + (f"  {run.skipped}" if run.skipped else ""),
            flush=True,
        )
        return run


def remove(path: Path) -> None:
    """Delete an output, directory or file, if it is there."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def durable_copy(src: Path, dst: Path) -> list[str]:
    """``dd`` of ``src`` to ``dst`` past the page cache, flushed before it exits (GNU dd
    writes the last partial block buffered and ``conv=fsync`` flushes it)."""
    return ["dd", f"if={src}", f"of={dst}", "bs=16M", "oflag=direct", "conv=fsync", "status=none"]


def weights_identical(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors")
    other = sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors")
    return names == other and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def bench_size(bench: Bench, layers: int, seed: int, torchtune: set[str]) -> dict:
    base = bench.workdir / f"{layers}L"
    hf, meta, out, copy = base / "hf", base / "meta", base / "out", base / "copy"
    if base.exists():
        shutil.rmtree(base)
    need = 3 * (layers * 405_000_000 + 525_000_000)  # three copies: 0.4 GB per layer + embeddings, lm_head
    free = shutil.disk_usage(bench.workdir).free
    if free < need + GB:
        raise SystemExit(f"{layers} layers need about {need / GB:.0f} GiB of disk, {free / GB:.0f} GiB free")
    t = time.perf_counter()
    total, largest = build_hf(hf, layers, seed)
    print(
        f"{layers} layers: built {total / MB:,.0f} MB of HF safetensors in {time.perf_counter() - t:.0f} s", flush=True
    )
    ck, tt = bench.ckptkit, [sys.executable, str(HERE / "torchtune_roundtrip.py")]
    check: dict = {}
    for rnd in range(bench.repeat):
        # odd rounds run each conversion before the cp of its input; the last runs cp first, so
        # the meta>hf output it verifies is the last thing written (at most 3 copies on disk)
        cp_first = rnd % 2 == 0 or rnd == bench.repeat - 1
        cp_hf = ("cp -r hf", ["cp", "-r", str(hf), str(copy)], [hf], copy)
        cp_meta = ("cp -r meta", ["cp", "-r", str(meta), str(copy)], [meta], copy)
        to_meta = ("convert hf>meta", [*ck, "convert", str(hf), str(meta), "--to", "meta", "--quiet"], [hf], meta)
        to_hf = ("convert meta>hf", [*ck, "convert", str(meta), str(out), "--to", "hf", "--quiet"], [meta], out)
        for first, second in ((cp_hf, to_meta), (cp_meta, to_hf)) if cp_first else ((to_meta, cp_hf), (to_hf, cp_meta)):
            for label, cmd, inputs, output in (first, second):
                bench.measure(layers, label, cmd, inputs, output)
                if output == copy or (output == out and not cp_first):  # keep at most 3 copies on disk
                    shutil.rmtree(output)
        if rnd == bench.repeat - 1:
            verify = subprocess.run([*ck, "verify", str(hf), str(out)], capture_output=True, text=True)
            check = {"verify": verify.returncode == 0, "identical": weights_identical(hf, out)}
            print(f"  verify hf vs meta>hf: {(verify.stdout or verify.stderr).strip().splitlines()[-1]}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        pth = meta / "consolidated.00.pth"
        bench.measure(layers, DURABLE, durable_copy(pth, base / "copy.pth"), [pth], base / "copy.pth")
        remove(base / "copy.pth")
        if bench.buffered_too:
            bench.measure(layers, BUFFERED, [*to_hf[1], "--copy-method", "stream"], [meta], out)
            shutil.rmtree(out)
        if bench.baseline:
            b = bench.ckptkit_baseline
            again = [
                (to_meta[0], [*b, "convert", str(hf), str(out), "--to", "meta", "--quiet"], [hf]),
                (to_hf[0], [*b, "convert", str(meta), str(out), "--to", "hf", "--quiet"], [meta]),
            ]
            if bench.buffered_too:
                again.append((BUFFERED, [*again[1][1], "--copy-method", "stream"], [meta]))
            for label, cmd, inputs in again if cp_first else again[::-1]:
                bench.measure(layers, label + BASELINE, cmd, inputs, out)
                shutil.rmtree(out)
        if "meta" in torchtune:
            bench.measure(
                layers, "torchtune meta load+save", [*tt, "meta", str(meta), str(out)], [meta], out, total // 5
            )
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(meta)
        argv = [*ck, "convert", str(hf), str(out), "--to", "internal", "--quiet"]
        pair = [("convert hf>internal", argv, out), ("cp -r hf (2)", ["cp", "-r", str(hf), str(copy)], copy)]
        for label, cmd, output in pair if not cp_first else pair[::-1]:
            bench.measure(layers, label, cmd, [hf], output)
            shutil.rmtree(output)
        if bench.baseline:
            cmd = [*bench.ckptkit_baseline, "convert", str(hf), str(out), "--to", "internal", "--quiet"]
            bench.measure(layers, "convert hf>internal" + BASELINE, cmd, [hf], out)
            shutil.rmtree(out)
        if "hf" in torchtune:
            bench.measure(layers, "torchtune hf load+save", [*tt, "hf", str(hf), str(out)], [hf], out, total * 11 // 10)
            shutil.rmtree(out, ignore_errors=True)
        bench.measure(layers, FLOOR_FREE, [sys.executable, "-c", "import ckptkit.cli, ckptkit.convert"], [])
        bench.measure(layers, FLOOR_TORCH, [sys.executable, "-c", "import ckptkit.cli, ckptkit.convert, torch"], [])
    return {"total": total, "largest": largest, **check}


# --- reporting -------------------------------------------------------------------------


def machine() -> dict[str, str]:
    import safetensors
    import torch

    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        platform.machine(),
    )
    try:
        from importlib.metadata import version

        torchtune = version("torchtune")
    except Exception:
        torchtune = "not installed"
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "ram": f"{meminfo()['MemTotal'] / GB:.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "torchtune": torchtune,
    }


def durable(run: Run) -> float:
    """Seconds until the output was on disk: the command, then the ``sync`` after it."""
    return run.wall_s + (run.sync_s or 0.0)


def ratios(bench: Bench, layers: int, num: str, den: str, synced: bool = False) -> list[float | None]:
    """Per round: wall of ``num`` / wall of ``den`` (None where either was skipped);
    ``synced``: each including the ``sync`` that followed it (:func:`durable`)."""
    a, b = bench.results.get((layers, num)), bench.results.get((layers, den))
    if a is None or b is None:
        return []
    t = durable if synced else (lambda r: r.wall_s)
    return [t(x) / t(y) if not (x.skipped or y.skipped) else None for x, y in zip(a.runs, b.runs, strict=True)]


def show(values: list[float | None]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return "n/a" if values else ""
    rounds = " / ".join("-" if v is None else f"{v:.2f}" for v in values)
    return f"**{statistics.median(done):.2f}** ({rounds})"


def report(bench: Bench, sizes: dict[int, dict], argv: list[str]) -> tuple[str, dict]:
    cache = "cold (inputs evicted)" if bench.cold else "warm (inputs read just before each run)"
    lines = [
        f"command: `{' '.join(argv)}`; page cache {cache}; {bench.repeat} interleaved rounds; "
        f"load average {min(bench.loads):.1f}-{max(bench.loads):.1f} on {os.cpu_count()} cores.",
        "",
        "| layers | size | command | wall s median (min-max) | + sync s | user s | sys s | peak RSS MB | "
        "wall / cp -r, per round | wall+sync / cp -r+sync, per round | torchtune / wall, per round |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    checks: list[tuple[str, bool]] = []
    for layers, info in sizes.items():
        for (n, label), m in bench.results.items():
            if n != layers:
                continue
            walls = [r.wall_s for r in m.done()]
            if not walls:
                why = {r.skipped for r in m.runs}
                lines.append(f"| {layers} | {info['total'] / MB:,.0f} MB | {label} | {'; '.join(why)} | | | | | | | |")
                continue
            cp = cp_sync = tt = ""
            if label in PEERS or label in VARIANTS:
                cp_label, tt_label, _ = PEERS.get(label) or VARIANTS[label]
                cp, tt = show(ratios(bench, layers, label, cp_label)), show(ratios(bench, layers, tt_label, label))
                cp_sync = show(ratios(bench, layers, label, cp_label, synced=True))
            syncs = [r.sync_s for r in m.done() if r.sync_s is not None]
            sync = f"{statistics.median(syncs):.2f}" if syncs else ""
            spread = f" ({min(walls):.2f}-{max(walls):.2f})" if len(walls) > 1 else ""
            lines.append(
                f"| {layers} | {info['total'] / MB:,.0f} MB | {label} | {statistics.median(walls):.2f}{spread} | "
                f"{sync} | {m.median('user_s'):.2f} | {m.median('sys_s'):.2f} | "
                f"{max(r.peak_rss for r in m.done()) / MB:,.0f} | {cp} | {cp_sync} | {tt} |"
            )
        for label, (cp_label, tt_label, floor_label) in PEERS.items():
            m = bench.results.get((layers, label))
            if m is None:
                continue
            cp_r = [v for v in ratios(bench, layers, label, cp_label) if v is not None]
            checks.append((f"{layers}L {label}: <= {CP_LIMIT:g}x cp -r (median {statistics.median(cp_r):.2f}x)",
                           statistics.median(cp_r) <= CP_LIMIT))  # fmt: skip
            cs_r = [v for v in ratios(bench, layers, label, cp_label, synced=True) if v is not None]
            med_sync = statistics.median(cs_r)
            checks.append((f"{layers}L {label}, until on disk: <= {CP_LIMIT:g}x cp -r + sync "
                           f"(median {med_sync:.2f}x)", med_sync <= CP_LIMIT))  # fmt: skip
            tt_r = [v for v in ratios(bench, layers, tt_label, label) if v is not None]
            if tt_r:
                med = statistics.median(tt_r)
                checks.append((f"{layers}L {label}: >= {TORCHTUNE_FACTOR:g}x faster than {tt_label} ({med:.1f}x)",
                               med >= TORCHTUNE_FACTOR))  # fmt: skip
            floor = max(r.peak_rss for r in bench.results[(layers, floor_label)].done())
            limit = 2 * info["largest"] + floor
            peak = max(r.peak_rss for r in m.done())
            checks.append((f"{layers}L {label}: peak RSS {peak / MB:.0f} MB <= 2 x {info['largest'] / MB:.0f} MB "
                           f"+ floor {floor / MB:.0f} MB = {limit / MB:.0f} MB", peak <= limit))  # fmt: skip
        if "verify" in info:
            checks.append((f"{layers}L round trip: `ckptkit verify` HF source vs meta>hf output", info["verify"]))
            checks.append((f"{layers}L round trip: meta>hf safetensors files byte-identical to the source",
                           info["identical"]))  # fmt: skip
    if len(sizes) > 1:
        for label in PEERS:
            peaks = {n: max(r.peak_rss for r in bench.results[(n, label)].done()) for n in sizes}
            flat = max(peaks.values()) <= min(peaks.values()) * (1 + RSS_FLAT)
            text = ", ".join(f"{n}L {p / MB:.0f} MB" for n, p in peaks.items())
            checks.append((f"{label}: peak RSS the same at every size, within 10 % ({text})", flat))
    lines += ["", "| target | met |", "|---|---|", *(f"| {c} | {'yes' if ok else '**no**'} |" for c, ok in checks)]
    lines += bounds(bench, sizes)
    lines += against_baseline(bench, sizes)
    raw = {
        "baseline": str(bench.baseline) if bench.baseline else None,
        "machine": machine(),
        "argv": argv,
        "repeat": bench.repeat,
        "load_average": [min(bench.loads), max(bench.loads)],
        "sizes": sizes,
        "measurements": [asdict(m) for m in bench.results.values()],
        "targets": dict(checks),
    }
    return "\n".join(lines), raw


def against_baseline(bench: Bench, sizes: dict[int, dict]) -> list[str]:
    """With ``--baseline``: each conversion's time over the baseline's in the same round
    (below 1: this tree is faster), and both peak RSS."""
    rows = []
    for layers in sizes:
        for label in (*PEERS, BUFFERED):
            now, then = bench.results.get((layers, label)), bench.results.get((layers, label + BASELINE))
            if now is None or then is None or not now.done() or not then.done():
                continue
            wall = show(ratios(bench, layers, label, label + BASELINE))
            synced = show(ratios(bench, layers, label, label + BASELINE, synced=True))
            rss = f"{max(r.peak_rss for r in now.done()) / MB:.0f} / {max(r.peak_rss for r in then.done()) / MB:.0f}"
            rows.append(
                f"| {layers}L {label} | {then.median('wall_s'):.2f} | {now.median('wall_s'):.2f} | {wall} "
                f"| {synced} | {rss} |"
            )
    if not rows:
        return []
    return [
        "",
        f"| this tree against the baseline ({bench.baseline}) | baseline wall s median | this tree wall s median "
        "| wall / baseline, per round | wall+sync / baseline+sync, per round | peak RSS MB, this / baseline |",
        "|---|---:|---:|---|---|---:|",
        *rows,
    ]


def bounds(bench: Bench, sizes: dict[int, dict]) -> list[str]:
    """What the durable copy (:data:`DURABLE`) reached against the targets' peers in the
    same rounds: where it misses a target, a conversion that leaves its output on disk
    meets it only by beating a plain copy of the same bytes."""
    rows = []
    for layers in sizes:
        dd, cp = bench.results.get((layers, DURABLE)), bench.results.get((layers, "cp -r meta"))
        if dd is None or cp is None or not dd.done():
            continue
        floor = bench.results.get((layers, FLOOR_FREE))
        start = floor.median("wall_s") if floor is not None and floor.done() else None
        alone = statistics.median(v for v in ratios(bench, layers, DURABLE, "cp -r meta") if v is not None)
        text = f"{alone:.2f}x"
        if start is not None:  # a Python tool also starts an interpreter and imports itself
            with_start = [(d.wall_s + start) / c.wall_s for d, c in zip(dd.runs, cp.runs, strict=True)
                          if not (d.skipped or c.skipped)]  # fmt: skip
            text += f"; + ckptkit's import floor {start:.2f} s: {statistics.median(with_start):.2f}x"
        rows.append(f"| {layers}L durable copy / cp -r meta, the command alone | {text} | <= {CP_LIMIT:g}x |")
        synced = statistics.median(v for v in ratios(bench, layers, DURABLE, "cp -r meta", True) if v is not None)
        rows.append(f"| {layers}L durable copy / cp -r meta, until on disk | {synced:.2f}x | <= {CP_LIMIT:g}x |")
        for tt_label in ("torchtune meta load+save", "torchtune hf load+save"):
            tt = [v for v in ratios(bench, layers, tt_label, DURABLE) if v is not None]
            if tt:
                median = statistics.median(tt)
                rows.append(f"| {layers}L {tt_label} / durable copy | {median:.2f}x | >= {TORCHTUNE_FACTOR:g}x |")
    if not rows:
        return []
    return ["", "| reference: the durable copy, medians of rounds | reached | target |", "|---|---:|---:|", *rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4], help="decoder layer counts (default: 4)")
    ap.add_argument("--workdir", type=Path, default=HERE / "out", help="where checkpoints go (default: bench/out)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--cold", action="store_true", help="evict inputs from the page cache before each run")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait before each command (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--no-torchtune", action="store_true", help="skip the torchtune runs")
    ap.add_argument(
        "--torchtune-meta-max-layers",
        type=int,
        default=64,
        help="run torchtune's Meta load+save only up to this many layers (default 64; HF always)",
    )
    ap.add_argument("--mem-limit-gb", type=float, default=20, help="memory in use a command may take the machine to")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    ap.add_argument(
        "--buffered-too", action="store_true", help="also time meta>hf through the page cache (--copy-method stream)"
    )
    ap.add_argument(
        "--baseline", type=Path, help="another ckptkit checkout: time its conversions too, in the same rounds"
    )
    args = ap.parse_args(argv)
    if args.repeat < 1 or any(n < 1 for n in args.layers):
        raise SystemExit("--repeat and --layers must be positive")
    torchtune = not args.no_torchtune
    if torchtune and subprocess.run([sys.executable, "-c", "import torchtune"], capture_output=True).returncode:
        print("torchtune is not importable: its runs are skipped", flush=True)
        torchtune = False
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(
        args.workdir.resolve(),
        args.repeat,
        args.cold,
        int(args.mem_limit_gb * GB),
        args.settle,
        args.buffered_too,
        args.baseline.resolve() if args.baseline else None,
    )
    print(" | ".join(f"{k} {v}" for k, v in machine().items()), flush=True)
    sizes: dict[int, dict] = {}
    try:
        for layers in args.layers:
            runs = {"hf", "meta"} if layers <= args.torchtune_meta_max_layers else {"hf"}
            sizes[layers] = bench_size(bench, layers, args.seed, runs if torchtune else set())
            shutil.rmtree(bench.workdir / f"{layers}L")
    finally:
        for layers in args.layers:
            shutil.rmtree(bench.workdir / f"{layers}L", ignore_errors=True)
    shown = ["python", "bench/convert.py", *(argv if argv is not None else sys.argv[1:])]
    table, raw = report(bench, sizes, shown)
    print()
    print(table)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    return 0 if all(info.get("verify") and info.get("identical") for info in sizes.values()) else 1


if __name__ == "__main__":
    with reporting("convert.py"):
        sys.exit(main())
