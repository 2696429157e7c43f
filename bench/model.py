"""Native model vs transformers' LlamaForCausalLM: forward+backward tokens/s and peak RSS on CPU.

Both models get the same ~100M-parameter Llama weights (same dtype) from one safetensors
file and run the same training step (cross-entropy over all positions, backward, no
optimizer). Each runs in its own subprocess so the peak RSS is per model.

    python bench/model.py                       # defaults below, prints a table
    python bench/model.py --steps 10 --seq 512 --batch 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Llama-3-style GQA config, 99.5M parameters (untied 32k vocab).
CONFIG = dict(vocab_size=32000, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64,
              intermediate_size=2048, norm_eps=1e-5, rope_theta=500000.0)  # fmt: skip


def canonical_config():
    from ckptkit.models.config import ModelConfig

    return ModelConfig(model_type="llama3", **CONFIG)


def hf_config():
    from transformers import LlamaConfig

    c = CONFIG
    return LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c["norm_eps"], rope_theta=c["rope_theta"],
        max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip


def make_weights(path: Path, dtype: torch.dtype) -> int:
    """Random canonical weights for both models, saved once."""
    from safetensors.torch import save_file

    from ckptkit.train.model import build_model

    torch.manual_seed(0)
    model = build_model(canonical_config(), dtype=dtype)
    model.init_weights()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model.num_parameters()


def build(which: str, weights: Path, dtype: torch.dtype) -> torch.nn.Module:
    from safetensors.torch import load_file

    from ckptkit.models import hf_key

    state = load_file(str(weights))
    if which == "ckptkit":
        from ckptkit.train.model import build_model

        model = build_model(canonical_config(), device="meta", dtype=dtype)
    else:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config()).to(dtype)
        state = {hf_key("llama3", k): v for k, v in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    if which != "ckptkit":  # transformers keeps its rope buffers out of the state dict; rebuild them off meta
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model.train()


def worker(which: str, weights: Path, dtype: torch.dtype, batch: int, seq: int, steps: int, warmup: int) -> dict:
    model = build(which, weights, dtype)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        step()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    best, median = min(times), sorted(times)[len(times) // 2]
    return {
        "which": which,
        "tokens_per_s_median": batch * seq / median,
        "tokens_per_s_best": batch * seq / best,
        "cpu_s_per_step": sorted(cpu)[len(cpu) // 2],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2, help="alternate the two models this many times")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    if args.worker:
        result = worker(args.worker, Path(args.weights), dtype, args.batch, args.seq, args.steps, args.warmup)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.safetensors"
        n_params = make_weights(weights, dtype)
        results: dict[str, list[dict]] = {"ckptkit": [], "transformers": []}
        for round_ in range(args.rounds):  # alternate who goes first: the machine may be shared
            for which in list(results)[:: 1 if round_ % 2 == 0 else -1]:
                cmd = [sys.executable, __file__, "--worker", which, "--weights", str(weights)]
                cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
                cmd += ["--warmup", str(args.warmup), "--dtype", args.dtype]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
                results[which].append(json.loads(out.strip().splitlines()[-1]))

    import transformers

    print(
        f"{n_params / 1e6:.1f}M-parameter Llama, {args.dtype}, batch {args.batch} x seq {args.seq}, "
        f"forward+backward, {args.steps} timed steps x {args.rounds} rounds, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}"
    )
    print("| model | tokens/s (median step) | tokens/s (best step) | CPU s / step | peak RSS (MiB) | loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for which, runs in results.items():
        med = max(r["tokens_per_s_median"] for r in runs)
        best = max(r["tokens_per_s_best"] for r in runs)
        cpu = min(r["cpu_s_per_step"] for r in runs)
        rss = max(r["peak_rss_mib"] for r in runs)
        print(f"| {which} | {med:,.0f} | {best:,.0f} | {cpu:.2f} | {rss:,.0f} | {runs[0]['loss']:.4f} |")
    print(
        "per round (tokens/s, median step): "
        + "; ".join(
            f"{w} " + ", ".join(f"{r['tokens_per_s_median']:,.0f}" for r in runs) for w, runs in results.items()
        )
    )


if __name__ == "__main__":
    main()
