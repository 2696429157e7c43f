"""Native model vs transformers' LlamaForCausalLM: forward+backward tokens/s and peak RSS on CPU.

Both models get the same ~100M-parameter Llama weights (same dtype) from one safetensors
file and run the same training step (cross-entropy over all positions, backward, no
optimizer). Three subprocesses: each model alone (its peak RSS and solo speed), then both
in one process alternating step by step, so that on a shared machine both see the same
load and the speed ratio stays meaningful.

    python bench/model.py                       # seq 512, batch 1, float32, 8 steps
    python bench/model.py --steps 12 --dtype bfloat16
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
from report import reporting

# Llama-3-style GQA config, 99.5M parameters (untied 32k vocab).
CONFIG = dict(vocab_size=32000, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64,
              intermediate_size=2048, norm_eps=1e-5, rope_theta=500000.0)  # fmt: skip


def canonical_config():
    from ckptkit.models import ModelConfig, get_family

    return ModelConfig(model_type="llama3", **CONFIG, extra=get_family("llama3").fields())


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

    from ckptkit.train.transformer import build_model

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
        from ckptkit.train.transformer import build_model

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


def make_step(model: torch.nn.Module, ids: torch.Tensor):
    """One training step without optimizer: forward, cross-entropy on all positions, backward."""

    def step() -> float:
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed(step) -> tuple[float, float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step()
    return time.perf_counter() - start, time.process_time() - start_cpu, loss


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def worker(which: list[str], weights: Path, dtype: torch.dtype, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """Time ``steps`` steps of each model, alternating step by step when there are two."""
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    step = {w: make_step(build(w, weights, dtype), ids) for w in which}
    for _ in range(warmup):
        for w in which:
            step[w]()
    wall: dict[str, list[float]] = {w: [] for w in which}
    cpu: dict[str, list[float]] = {w: [] for w in which}
    loss = {}
    for i in range(steps):
        for w in which if i % 2 == 0 else which[::-1]:
            t, c, loss[w] = timed(step[w])
            wall[w].append(t)
            cpu[w].append(c)
    return {
        w: {
            "tokens_per_s": batch * seq / median(wall[w]),
            "tokens_per_s_best": batch * seq / min(wall[w]),
            "tokens_per_cpu_s": batch * seq / median(cpu[w]),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": loss[w],
        }
        for w in which
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model and run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    if args.worker:
        result = worker(
            args.worker.split(","), Path(args.weights), dtype, args.batch, args.seq, args.steps, args.warmup
        )
        print(json.dumps(result))
        return

    def run(which: str, weights: Path) -> dict:
        cmd = [sys.executable, __file__, "--worker", which, "--weights", str(weights), "--dtype", args.dtype]
        cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
        return json.loads(out.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.safetensors"
        n_params = make_weights(weights, dtype)
        # Alone, one process per model: peak RSS is that model's (weights + grads + activations).
        solo = {w: run(w, weights)[w] for w in ("ckptkit", "transformers")}
        # Both in one process, alternating steps: same machine load for both, so the
        # speed ratio holds even on a shared machine.
        both = run("ckptkit,transformers", weights)

    import transformers

    print(
        f"{n_params / 1e6:.1f}M-parameter Llama (GQA), {args.dtype}, batch {args.batch} x seq {args.seq}, "
        f"forward+backward, median of {args.steps} steps; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}"
    )
    print()
    print(
        "| model | tokens/s alone | tokens/s interleaved (median) | tokens/s interleaved (best step) "
        "| tokens per CPU-second | peak RSS alone (MiB) | loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for w in ("ckptkit", "transformers"):
        print(
            f"| {w} | {solo[w]['tokens_per_s']:,.0f} | {both[w]['tokens_per_s']:,.0f} | "
            f"{both[w]['tokens_per_s_best']:,.0f} | "
            f"{both[w]['tokens_per_cpu_s']:,.0f} | {solo[w]['peak_rss_mib']:,.0f} | {solo[w]['loss']:.4f} |"
        )
    ratio = both["ckptkit"]["tokens_per_s"] / both["transformers"]["tokens_per_s"]
    best = both["ckptkit"]["tokens_per_s_best"] / both["transformers"]["tokens_per_s_best"]
    print(f"\nckptkit / transformers speed, interleaved: {ratio:.2f}x (median step), {best:.2f}x (best step)")


if __name__ == "__main__":
    with reporting("model.py"):
        main()
