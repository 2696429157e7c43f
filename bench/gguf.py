"""Benchmark HF -> GGUF and Meta -> GGUF: ``ckptkit convert --to gguf`` against llama.cpp's
own ``convert_hf_to_gguf.py``, on Llama-2-7B-shaped checkpoints.

For each layer count (default 4) it builds a synthetic HF checkpoint (``bench/synthetic.py``:
Llama-2-7B shapes, bf16, random data) with Llama 2's sentencepiece vocabulary (rebuilt from
llama.cpp's ``ggml-vocab-llama-spm.gguf``, as the tests do) and the same weights as Meta's
``consolidated.00.pth`` (``ckptkit convert --to meta``, untimed), and runs ``--repeat``
interleaved rounds (default 3; the order of the commands rotates every round) of, for each
outtype (``bf16`` and ``q8_0``):

* ``ckptkit convert HF out.gguf --to gguf --dtype bfloat16|q8_0`` (fsyncs what it publishes);
* ``ckptkit convert META out.gguf --to gguf --dtype bfloat16|q8_0`` (no HF step);
* ``python convert_hf_to_gguf.py HF --outfile out.gguf --outtype bf16|q8_0`` from the
  llama-cpp-python 0.3.36 sdist (the tests' copy: ``tests/tokenizer_helpers.py``);
* with the first outtype only, the floor of any converter on this disk: ``cp -r HF`` + sync,
  and with ``--dd`` a durable ``dd`` of the largest shard (past the page cache, fsynced).

Each command is its own process under GNU ``time`` (``bench/convert.py``'s ``run_child``:
wall, peak RSS) after an untimed read of its source (warm cache; the other checkpoint's
pages dropped first, as both may not fit), followed by a timed
``sync``: "until on disk" is command + sync. Medians over rounds; ratios per round; the
1-minute load average before and after each round (the machine is shared). In the last
round of each outtype, each file is read with the ``gguf`` package's ``GGUFReader`` once timed
and its tensors (names, types, shapes, SHA-256 of bytes) compared with llama.cpp's: the
timings are of the same output. Each output is deleted as soon as it is timed, the
synthetic checkpoints at the end unless ``--keep``.

Run::

    python bench/gguf.py [--layers 4] [--repeat 3] [--outtypes bf16 q8_0] [--dd] [--keep]
        [--out bench/out/gguf] [--report docs/bench/gguf.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from convert import Run, durable_copy, evict, remove, timed, warm  # noqa: E402
from report import reporting  # noqa: E402

# This script is bench/gguf.py: without its folder on the path, ``import gguf`` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

GB = 1 << 30
OUTTYPES = {"bf16": "bfloat16", "q8_0": "q8_0"}


def build(work: Path, layers: int) -> Path:
    """The synthetic HF checkpoint with Llama 2's tokenizer.model, built once."""
    from synthetic import build_hf

    from tokenizer_helpers import llama2_tokenizer_model

    hf = work / f"hf-{layers}"
    if (hf / "tokenizer.model").is_file():
        return hf
    shutil.rmtree(hf, ignore_errors=True)
    build_hf(hf, layers, seed=0)
    shutil.copy(llama2_tokenizer_model(), hf / "tokenizer.model")
    return hf


def tensor_digest(path: Path) -> list[tuple[str, int, list[int], str]]:
    """Each tensor's name, GGML type, shape and SHA-256 of its bytes (the file can then go:
    at 32 layers three outputs would not fit beside the sources)."""
    import hashlib

    from gguf import GGUFReader

    return [
        (t.name, int(t.tensor_type), [int(x) for x in t.shape], hashlib.sha256(t.data.tobytes()).hexdigest())
        for t in GGUFReader(path).tensors
    ]


def crc_speeds() -> str:
    """The speed of zip's CRC-32 in memory here, zlib's and the one ckptkit uses (best of 5
    over 64 MiB): what checking a .pth's records costs Meta -> GGUF."""
    import zlib

    from ckptkit.io import crc32
    from ckptkit.io.crc import IMPLEMENTATION

    data = memoryview(os.urandom(64 << 20))
    speeds = []
    for fn in (zlib.crc32, crc32):
        best = min(_timed(fn, data) for _ in range(5))
        speeds.append(len(data) / best / GB)
    return f"CRC-32 in memory: zlib {speeds[0]:.1f} GiB/s, ckptkit's ({IMPLEMENTATION}) {speeds[1]:.1f} GiB/s"


def _timed(fn: Callable[[memoryview], int], data: memoryview) -> float:
    start = time.perf_counter()
    fn(data)
    return time.perf_counter() - start


def until_on_disk(run: Run) -> float:
    return run.wall_s + (run.sync_s or 0)


def build_meta(work: Path, hf: Path, layers: int) -> Path:
    """The same checkpoint as Meta's consolidated.00.pth (ckptkit convert --to meta), built once."""
    meta = work / f"meta-{layers}"
    if (meta / "params.json").is_file():
        return meta
    shutil.rmtree(meta, ignore_errors=True)
    cmd = [sys.executable, "-m", "ckptkit", "convert", str(hf), str(meta), "--to", "meta", "--quiet"]
    subprocess.run(cmd, check=True)
    return meta


def per_round(num: list[Run], den: list[Run], attr: str = "disk") -> str:
    values = [
        (until_on_disk(a) / until_on_disk(b)) if attr == "disk" else a.peak_rss / b.peak_rss
        for a, b in zip(num, den, strict=True)
    ]
    return f"{', '.join(f'{x:.2f}x' for x in values)}; median {statistics.median(values):.2f}x"


def main(argv: list[str] | None = None) -> int:
    from tokenizer_helpers import llama_cpp_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--outtypes", nargs="+", choices=list(OUTTYPES), default=list(OUTTYPES))
    parser.add_argument("--dd", action="store_true", help="also time a durable dd of the largest shard")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gguf"))
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    llama_cpp = llama_cpp_dir()
    env_path = str(llama_cpp / "gguf-py")
    for layers in args.layers:
        src = build(args.out, layers)
        meta = build_meta(args.out, src, layers)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"{layers} layers of Llama-2-7B shapes: HF safetensors, bf16, {size / GB:.2f} GiB; {args.repeat} rounds")
        print(f"(Meta: the same weights as consolidated.00.pth; 1-minute load average {os.getloadavg()[0]:.1f})")
        print(crc_speeds())
        for outtype in args.outtypes:
            dtype = OUTTYPES[outtype]
            outs = {
                "ckptkit": args.out / "ckptkit.gguf",
                "meta": args.out / "ckptkit-meta.gguf",
                "llama.cpp": args.out / "llama-cpp.gguf",
                "cp": args.out / "copy",
                "dd": args.out / "dd.safetensors",
            }
            ours = ["--to", "gguf", "--dtype", dtype, "--quiet"]
            largest = max(src.glob("*.safetensors"), key=lambda p: p.stat().st_size)
            commands = {
                "ckptkit": [sys.executable, "-m", "ckptkit", "convert", str(src), str(outs["ckptkit"]), *ours],
                "meta": [sys.executable, "-m", "ckptkit", "convert", str(meta), str(outs["meta"]), *ours],
                "llama.cpp": ["env", f"PYTHONPATH={env_path}", sys.executable, "convert_hf_to_gguf.py", str(src)]
                + ["--outfile", str(outs["llama.cpp"]), "--outtype", outtype],
                "cp": ["cp", "-r", str(src), str(outs["cp"])],
                "dd": durable_copy(largest, outs["dd"]),
            }
            names = ["ckptkit", "meta", "llama.cpp"]
            if outtype == args.outtypes[0]:  # the copy baselines do not depend on the outtype
                names += ["cp"] + (["dd"] if args.dd else [])
            reads = {"meta": [meta], "dd": [largest]}
            runs: dict[str, list[Run]] = {name: [] for name in names}
            digests: dict[str, list[tuple[str, int, list[int], str]]] = {}
            load = [os.getloadavg()[0]]
            for r in range(args.repeat):
                order = names[r % len(names) :] + names[: r % len(names)]  # rotated every round
                for name in order:
                    remove(outs[name])
                    os.sync()
                    # the other checkpoint's pages dropped first: at 32 layers both do not fit in
                    # the page cache, and pages read twice (the last command's source) would stay
                    # while this one's, read once, were evicted
                    evict([p for p in (src, meta) if p not in reads.get(name, [src])])
                    warm(reads.get(name, [src]))
                    cwd = llama_cpp if name == "llama.cpp" else None
                    runs[name].append(timed(commands[name], args.out / f"{name}-{outtype}-{r}.log", cwd))
                    if r == args.repeat - 1 and name not in ("cp", "dd"):
                        digests[name] = tensor_digest(outs[name])
                    remove(outs[name])
                load.append(os.getloadavg()[0])
            identical = digests["ckptkit"] == digests["llama.cpp"]
            # the Meta copy records the HF folder it came from: its GGUF follows that folder's order
            meta_identical = digests["meta"] == digests["llama.cpp"]
            print(
                f"\n--outtype {outtype} (tensors identical to llama.cpp's, in its order: "
                f"HF {'yes' if identical else 'NO'}, Meta {'yes' if meta_identical else 'NO'}; "
                f"load average {', '.join(f'{x:.1f}' for x in load)})"
            )
            print(f"{'command':<40} {'wall s':>8} {'+sync s':>8} {'peak RSS':>10}")
            labels = {
                "ckptkit": "ckptkit convert HF --to gguf",
                "meta": "ckptkit convert Meta --to gguf",
                "llama.cpp": "convert_hf_to_gguf.py HF",
                "cp": "cp -r HF (+ sync)",
                "dd": f"dd oflag=direct conv=fsync, {largest.stat().st_size / GB:.2f} GiB",
            }
            for name in names:
                wall = statistics.median(x.wall_s for x in runs[name])
                disk = statistics.median(until_on_disk(x) for x in runs[name])
                rss = statistics.median(x.peak_rss for x in runs[name]) / GB
                print(f"{labels[name]:<40} {wall:>8.2f} {disk:>8.2f} {rss:>6.2f} GiB")
            theirs, hf, direct = runs["llama.cpp"], runs["ckptkit"], runs["meta"]
            print(f"until on disk, llama.cpp / ckptkit HF per round: {per_round(theirs, hf)}")
            print(f"until on disk, llama.cpp / ckptkit Meta per round: {per_round(theirs, direct)}")
            print(f"until on disk, ckptkit HF / ckptkit Meta per round: {per_round(hf, direct)}")
            if "cp" in runs:
                print(f"until on disk, ckptkit HF / cp -r per round: {per_round(hf, runs['cp'])}")
            print(f"peak RSS, llama.cpp / ckptkit HF per round: {per_round(theirs, hf, 'rss')}")
            print(f"peak RSS, llama.cpp / ckptkit Meta per round: {per_round(theirs, direct, 'rss')}")
        if not args.keep:
            shutil.rmtree(src)
            shutil.rmtree(meta)
    return 0


if __name__ == "__main__":
    with reporting("gguf.py"):
        code = main()
    sys.exit(code)
