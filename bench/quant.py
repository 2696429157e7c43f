"""Benchmark dequantizing a block-FP8 checkpoint: ``ckptkit convert --to hf --dtype bfloat16``
against a durable ``dd`` of the output's size, in the same rounds.

The source is a synthetic Llama-3-8B-shaped HF folder (hidden 4096, intermediate 14336, 8 kv
heads; ``--layers`` layers, default 2), every linear weight quantized by the published formula
(``scale_inv = amax / 448`` per 128 x 128 block, e4m3), float32 ``weight_scale_inv``, bf16
embeddings, norms and ``lm_head`` (vocab 128256), with DeepSeek's ``quantization_config``.
Each round (``--repeat``, default 3) warms the source, then times, each as its own process
under GNU ``time`` followed by a timed ``sync`` ("until on disk"):

* ``ckptkit convert SRC OUT --to hf --dtype bfloat16`` (the reference dequantization, one
  tensor and its scale at a time; fsyncs what it publishes);
* ``dd`` of a file of the output's weight bytes past the page cache, fsynced.

Medians over rounds, peak RSS, and the load average (the machine is shared). Run::

    python bench/quant.py [--layers 2] [--repeat 3] [--out bench/out/quant] [--report docs/bench/quant.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import durable_copy, remove, run_child, warm  # noqa: E402
from report import reporting  # noqa: E402

HIDDEN, INTER, KV, VOCAB = 4096, 14336, 1024, 128256
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def build(root: Path, layers: int) -> Path:
    """The synthetic FP8 source (built once, kept between runs)."""
    import torch
    from safetensors.torch import save_file

    from ckptkit.quant.fp8 import BlockFP8

    src = root / f"src-{layers}"
    if (src / "config.json").exists():
        return src
    src.mkdir(parents=True, exist_ok=True)
    method = BlockFP8(CONFIG, src)
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16) * 0.02,
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16) * 0.02,
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }  # fmt: skip
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for name, shape in shapes.items():
            q, s = method.quantize(torch.randn(shape, generator=gen) * 0.02)
            tensors[f"model.layers.{i}.{name}.weight"] = q
            tensors[f"model.layers.{i}.{name}.weight_scale_inv"] = s
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": CONFIG,
    }  # fmt: skip
    (src / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/quant"))
    args = parser.parse_args()
    src = build(args.out, args.layers)
    out = args.out / "out"
    blob = args.out / "blob"
    times: dict[str, list[float]] = {"ckptkit": [], "dd": []}
    rss: dict[str, int] = {}
    for r in range(args.repeat):
        warm([src])
        load = os.getloadavg()[0]
        remove(out)
        ckptkit = [sys.executable, "-m", "ckptkit", "convert", str(src), str(out), "--to", "hf", "--dtype", "bfloat16"]
        run, rc = run_child(ckptkit, args.out / "ckptkit.log")
        assert rc == 0, (args.out / "ckptkit.log").read_text()[-2000:]
        start = time.perf_counter()
        os.sync()
        times["ckptkit"].append(run.wall_s + time.perf_counter() - start)
        rss["ckptkit"] = run.peak_rss
        size = (out / "model.safetensors").stat().st_size
        if not blob.exists() or blob.stat().st_size != size:
            with blob.open("wb") as f:
                f.truncate(size)
        remove(args.out / "dd.out")
        run, rc = run_child(durable_copy(blob, args.out / "dd.out"), args.out / "dd.log")
        assert rc == 0
        start = time.perf_counter()
        os.sync()
        times["dd"].append(run.wall_s + time.perf_counter() - start)
        rss["dd"] = run.peak_rss
        print(f"round {r + 1}: ckptkit {times['ckptkit'][-1]:.2f} s, dd {times['dd'][-1]:.2f} s, load {load:.2f}")
    gib = size / (1 << 30)
    print(f"FP8 source {args.layers} layers (8B shapes) -> bf16 output {gib:.2f} GiB, medians of {args.repeat} rounds")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:8s} {med:7.2f} s until on disk  {gib / med:6.2f} GiB/s  peak RSS {rss[name] / (1 << 20):.0f} MiB")
    remove(out)
    remove(args.out / "dd.out")


if __name__ == "__main__":
    with reporting("quant.py"):
        main()
