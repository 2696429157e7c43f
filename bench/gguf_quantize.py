"""Benchmark HF -> quantized GGUF (``--dtype Q4_K_M``, ``Q6_K``): ckptkit's one streamed pass
against llama.cpp's two steps, on Llama-3-8B-shaped layers.

The source: a synthetic HF checkpoint of N decoder layers (default 1) of Llama-3-8B's shapes
(hidden 4096, 32 heads over 8 KV heads, intermediate 14336; bf16, random data shaped like
trained weights, ``bench/synthetic.py``'s generator), with the bundled llama2 fixture's
sentencepiece vocabulary (384 tokens: the embedding and output matrices are small, so the
layers are what is timed; ``--vocab-size 128256`` for Llama 3's, random tokenizer aside).
Interleaved rounds (``--repeat``, default 3; the order rotates every round), per type:

* ``ckptkit convert HF out.gguf --to gguf --dtype TYPE`` (fsyncs what it publishes);
* llama.cpp: ``convert_hf_to_gguf.py HF --outtype bf16`` then ``llama-quantize IN OUT TYPE
  NTHREADS`` on this process's CPUs (the build ``tests/formats/make_llama_quantize_golden.py``
  names, ``--llama-quantize``), the 16-bit file deleted after; its time is the sum of both.

Each command is its own process under GNU ``time`` (wall, peak RSS), then ``sync``: "until on
disk" is command + sync. In the last round both outputs' tensors are compared (sha256 of each
tensor's bytes): the timings are of the same file. Medians; the 1-minute load average before
and after each round (the machine may be shared).

Run::

    python bench/gguf_quantize.py [--layers 1] [--repeat 3] [--types Q4_K_M Q6_K]
        [--llama-quantize PATH] [--out bench/out/gguf_quantize] [--report docs/bench/gguf_quantize.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from convert import Run, remove, timed, warm  # noqa: E402
from report import reporting  # noqa: E402

# This script's folder holds bench/gguf.py: without it on the path, ``import gguf`` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

GB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 4096, 32, 8, 14336
DEFAULT_QUANTIZE = Path("/work/cache/lq/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize")


def build(root: Path, layers: int, vocab: int) -> Path:
    """The synthetic checkpoint (one shard per layer), built once."""
    import torch
    from safetensors.torch import save_file
    from synthetic import random_tensor

    out = root / f"hf8b-{layers}-{vocab}"
    if (out / "config.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    fixture = ROOT / "fixtures" / "hf" / "llama2"
    kv = HIDDEN // HEADS * KV_HEADS
    shards: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (vocab, HIDDEN)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "input_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.k_proj.weight": (kv, HIDDEN),
                p + "self_attn.v_proj.weight": (kv, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            }
        )
    shards.append({"model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN)})
    weight_map = {}
    for i, shapes in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: random_tensor(s, gen) for k, s in shapes.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shapes, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((fixture / "config.json").read_text())
    config.update(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers, vocab_size=vocab, head_dim=HIDDEN // HEADS, tie_word_embeddings=False,
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in fixture.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def digest(path: Path) -> list[tuple[str, str, str]]:
    import hashlib

    from gguf import GGUFReader

    return [
        (t.name, t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()) for t in GGUFReader(path).tensors
    ]


def on_disk(runs: list[Run]) -> float:
    return sum(r.wall_s + (r.sync_s or 0) for r in runs)


def main(argv: list[str] | None = None) -> int:
    from tokenizer_helpers import llama_cpp_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q6_K"])
    parser.add_argument("--llama-quantize", type=Path, default=DEFAULT_QUANTIZE)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gguf_quantize"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.vocab_size != 384:
        raise SystemExit("--vocab-size: only the fixture's 384 tokens have a tokenizer here")
    llama_cpp = llama_cpp_dir()
    src = build(out, args.layers, args.vocab_size)
    threads = len(os.sched_getaffinity(0))
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(
        f"{args.layers} layer(s) of Llama-3-8B shapes (hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV, "
        f"intermediate {INTERMEDIATE}), vocab {args.vocab_size}: HF safetensors bf16, {size / GB:.2f} GiB; "
        f"{args.repeat} rounds; {threads} CPUs; llama-quantize with {threads} threads"
    )
    env = f"PYTHONPATH={llama_cpp / 'gguf-py'}"
    for ftype in args.types:
        mine, bf16, theirs = out / "ckptkit.gguf", out / "bf16.gguf", out / "llama-cpp.gguf"
        ours = [sys.executable, "-m", "ckptkit", "convert", str(src), str(mine), "--to", "gguf", "--dtype", ftype]
        step1 = ["env", env, sys.executable, "convert_hf_to_gguf.py", str(src), "--outfile", str(bf16)]
        step1 += ["--outtype", "bf16"]
        step2 = [str(args.llama_quantize), str(bf16), str(theirs), ftype, str(threads)]
        runs: dict[str, list[list[Run]]] = {"ckptkit": [], "llama.cpp": []}
        load = [os.getloadavg()[0]]
        same = None
        for r in range(args.repeat):
            for name in ["ckptkit", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "ckptkit"]:
                warm([src])
                if name == "ckptkit":
                    runs[name].append([timed([*ours, "--quiet", "--force"], out / f"ours-{ftype}-{r}.log")])
                else:
                    first = timed(step1, out / f"convert-{ftype}-{r}.log", llama_cpp)
                    second = timed(step2, out / f"quantize-{ftype}-{r}.log")
                    remove(bf16)
                    runs[name].append([first, second])
            if r == args.repeat - 1:
                same = digest(mine) == digest(theirs)
            remove(mine)
            remove(theirs)
            load.append(os.getloadavg()[0])
        print(f"\n--dtype {ftype} (tensors identical to llama-quantize's: {'yes' if same else 'NO'}; load average "
              f"{', '.join(f'{x:.1f}' for x in load)})")  # fmt: skip
        print(f"{'command':<52} {'until on disk s (median)':>24} {'peak RSS':>10}  rounds")
        labels = {
            "ckptkit": "ckptkit convert HF --dtype " + ftype,
            "llama.cpp": "convert_hf_to_gguf bf16 + llama-quantize",
        }
        for name, label in labels.items():
            disk = [on_disk(x) for x in runs[name]]
            rss = statistics.median(max(r.peak_rss for r in x) for x in runs[name]) / GB
            each = ", ".join(f"{d:.1f}" for d in disk)
            print(f"{label:<52} {statistics.median(disk):>24.1f} {rss:>6.2f} GiB  {each}")
        if runs["llama.cpp"]:
            steps = [[x[0].wall_s + (x[0].sync_s or 0), x[1].wall_s + (x[1].sync_s or 0)] for x in runs["llama.cpp"]]
            print(
                f"llama.cpp's steps (median s): convert {statistics.median(s[0] for s in steps):.1f}, "
                f"llama-quantize {statistics.median(s[1] for s in steps):.1f}"
            )
            ratio = [on_disk(a) / on_disk(b) for a, b in zip(runs["ckptkit"], runs["llama.cpp"], strict=True)]
            print(f"ckptkit / llama.cpp's two steps, per round: {', '.join(f'{x:.2f}x' for x in ratio)}")
    return 0


if __name__ == "__main__":
    with reporting("gguf_quantize.py"):
        code = main()
    sys.exit(code)
