"""KL divergence and top-1 agreement of each ``--dtype`` GGUF quantization against its source,
for the bundled fixtures: ``ckptkit convert FIXTURE out.gguf --to gguf --dtype TYPE``, then
``verify --logits``'s comparison (``ckptkit.train.logit_check.compare_logits``: the native
decoder on the source and on the GGUF's dequantized weights, on the bundled corpus).

The fixtures are tiny random models (rows of 64 and 192, which no 256-value block divides:
the K types fall back as llama-quantize does, see the types column), so the figures rank the
block formats on random weights, not a trained model's quality loss.

Run::

    python bench/gguf_logits.py [--fixtures llama2 mistral] [--types Q4_0 Q6_K]
        [--report docs/bench/gguf_logits.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from report import reporting  # noqa: E402

# This script's folder holds bench/gguf.py: without it on the path, ``import gguf`` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def types_written(path: Path) -> str:
    """The GGML types of the quantized tensors in ``path``, most common first."""
    import gguf

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)
    return " ".join(f"{n}x{k}" for k, n in counts.most_common())


def main() -> None:
    from ckptkit.convert import ConvertOptions, convert
    from ckptkit.formats.gguf.mix import FILE_TYPES
    from ckptkit.train.logit_check import compare_logits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", nargs="*", default=["llama2", "mistral"])
    parser.add_argument("--types", nargs="*", default=list(dict.fromkeys(["Q8_0", *FILE_TYPES])))
    args = parser.parse_args()
    print("| fixture | --dtype | 2-D tensors written as | KL mean (nats) | KL max | top-1 agreement |")
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in args.fixtures:
            src = ROOT / "fixtures" / "hf" / fixture
            for kind in args.types:
                out = Path(tmp) / f"{fixture}-{kind}.gguf"
                convert(src, out, ConvertOptions("gguf", dtype=kind.lower()))
                r = compare_logits(src, out)
                print(
                    f"| {fixture} | {kind} | {types_written(out)} | {r['kl_mean']:.3g} | {r['kl_max']:.3g} "
                    f"| {r['top1_agreement']:.1%} |",
                    flush=True,
                )
                out.unlink()


if __name__ == "__main__":
    with reporting("gguf_logits.py"):
        main()
