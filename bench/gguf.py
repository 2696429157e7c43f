"""Benchmark HF -> GGUF: ``ckptkit convert --to gguf`` against llama.cpp's own
``convert_hf_to_gguf.py``, on Llama-2-7B-shaped checkpoints.

For each layer count (default 4) it builds a synthetic HF checkpoint (``bench/synthetic.py``:
Llama-2-7B shapes, bf16, random data) with Llama 2's sentencepiece vocabulary (rebuilt from
llama.cpp's ``ggml-vocab-llama-spm.gguf``, as the tests do), and runs ``--repeat``
interleaved rounds (default 3; the order of the two tools swaps every round) of, for each
outtype (``bf16`` and ``q8_0``):

* ``ckptkit convert HF out.gguf --to gguf --dtype bfloat16|q8_0`` (fsyncs what it publishes);
* ``python convert_hf_to_gguf.py HF --outfile out.gguf --outtype bf16|q8_0`` from the
  llama-cpp-python 0.3.36 sdist (the tests' copy: ``tests/tokenizer_helpers.py``).

Each command is its own process under GNU ``time`` (``bench/convert.py``'s ``run_child``:
wall, peak RSS) after an untimed read of the source (warm cache), followed by a timed
``sync``: "until on disk" is command + sync. Medians over rounds; ratios per round. After the
last round of each outtype, both files are read with the ``gguf`` package's ``GGUFReader``
and their tensors compared (names, types, shapes, bytes): the timings are of the same output.

Run::

    python bench/gguf.py [--layers 4] [--repeat 3] [--out bench/out/gguf] [--report docs/bench/gguf.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from convert import Run, run_child, warm  # noqa: E402
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


def timed(argv: list[str], log: Path, cwd: Path | None = None) -> Run:
    here = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
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


def same_tensors(a: Path, b: Path) -> bool:
    from gguf import GGUFReader

    ta, tb = GGUFReader(a).tensors, GGUFReader(b).tensors
    if [(t.name, t.tensor_type, list(t.shape)) for t in ta] != [(t.name, t.tensor_type, list(t.shape)) for t in tb]:
        return False
    return all(x.data.tobytes() == y.data.tobytes() for x, y in zip(ta, tb, strict=True))


def until_on_disk(run: Run) -> float:
    return run.wall_s + (run.sync_s or 0)


def main(argv: list[str] | None = None) -> int:
    from tokenizer_helpers import llama_cpp_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gguf"))
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    llama_cpp = llama_cpp_dir()
    env_path = str(llama_cpp / "gguf-py")
    for layers in args.layers:
        src = build(args.out, layers)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"{layers} layers of Llama-2-7B shapes: HF safetensors, bf16, {size / GB:.2f} GiB; {args.repeat} rounds")
        for outtype, dtype in OUTTYPES.items():
            outs = {"ckptkit": args.out / "ckptkit.gguf", "llama.cpp": args.out / "llama-cpp.gguf"}
            commands = {
                "ckptkit": [sys.executable, "-m", "ckptkit", "convert", str(src), str(outs["ckptkit"])]
                + ["--to", "gguf", "--dtype", dtype, "--quiet"],
                "llama.cpp": ["env", f"PYTHONPATH={env_path}", sys.executable, "convert_hf_to_gguf.py", str(src)]
                + ["--outfile", str(outs["llama.cpp"]), "--outtype", outtype],
            }
            runs: dict[str, list[Run]] = {"ckptkit": [], "llama.cpp": []}
            for r in range(args.repeat):
                for name in ["ckptkit", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "ckptkit"]:
                    outs[name].unlink(missing_ok=True)
                    os.sync()
                    warm([src])
                    cwd = llama_cpp if name == "llama.cpp" else None
                    runs[name].append(timed(commands[name], args.out / f"{name}-{outtype}-{r}.log", cwd))
            identical = same_tensors(outs["ckptkit"], outs["llama.cpp"])
            for p in outs.values():
                p.unlink()
            print(f"\n--outtype {outtype} (tensors of both outputs identical: {'yes' if identical else 'NO'})")
            print(f"{'converter':<34} {'wall s':>8} {'+sync s':>8} {'peak RSS':>10}")
            for name, label in (("ckptkit", "ckptkit convert --to gguf"), ("llama.cpp", "convert_hf_to_gguf.py")):
                wall = statistics.median(x.wall_s for x in runs[name])
                disk = statistics.median(until_on_disk(x) for x in runs[name])
                rss = statistics.median(x.peak_rss for x in runs[name]) / GB
                print(f"{label:<34} {wall:>8.2f} {disk:>8.2f} {rss:>6.2f} GiB")
            speed = [
                until_on_disk(t) / until_on_disk(c) for c, t in zip(runs["ckptkit"], runs["llama.cpp"], strict=True)
            ]
            memory = [t.peak_rss / c.peak_rss for c, t in zip(runs["ckptkit"], runs["llama.cpp"], strict=True)]
            print(
                f"until on disk, llama.cpp / ckptkit per round: {', '.join(f'{x:.2f}x' for x in speed)}; "
                f"median {statistics.median(speed):.2f}x"
            )
            print(
                f"peak RSS, llama.cpp / ckptkit per round: {', '.join(f'{x:.2f}x' for x in memory)}; "
                f"median {statistics.median(memory):.2f}x"
            )
    return 0


if __name__ == "__main__":
    with reporting("gguf.py"):
        code = main()
    sys.exit(code)
