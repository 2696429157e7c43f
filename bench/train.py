"""Training throughput: ckptkit's recipes vs a plain transformers (+ PEFT) loop, on CPU.

Same model (a ~30M-parameter Llama written by transformers' save_pretrained), same data
(the fixture corpus repeated, tokenised by the fixture tokenizer into fixed-length chunks),
same batches in the same order, same AdamW settings, float32. Each run is its own
subprocess, so peak RSS is per run; tokens/s is the median over optimizer steps after
two warm-up steps (checkpoint writing is not timed).

    python bench/train.py                  # defaults below, prints a markdown table
    python bench/train.py --steps 20 --seq 256 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "hf" / "llama2"  # its tokenizer; vocabulary 384
MODEL = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=384, max_position_embeddings=2048)  # fmt: skip
LORA = dict(rank=8, alpha=16, targets=["q", "k", "v", "o"])
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def make_model(path: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, rope_theta=10000.0, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, path / name)
    corpus = (REPO / "fixtures" / "corpus.txt").read_text().splitlines()
    (path / "data.txt").write_text("\n".join(corpus * 40) + "\n")  # enough chunks for every step
    return model.num_parameters()


def recipe_config(model: Path, out: Path, args: argparse.Namespace, lora: bool) -> dict:
    cfg = {
        "seed": 0, "device": "cpu", "dtype": "fp32", "quiet": True,
        "checkpointer": {"checkpoint_dir": str(model), "output_dir": str(out)},
        "dataset": {"type": "text", "source": str(model / "data.txt"), "max_seq_len": args.seq},
        "epochs": 1, "batch_size": args.batch, "max_steps_per_epoch": args.steps,
        "optimizer": {"lr": 1e-4}, "lr_scheduler": {"warmup_steps": 0}, "clip_grad_norm": 1.0,
        "log_every_n_steps": 1,
    }  # fmt: skip
    if lora:
        cfg["lora"] = dict(LORA, dropout=0.0)
    return cfg


def worker_ckptkit(model: Path, out: Path, args: argparse.Namespace, lora: bool) -> list[float]:
    from ckptkit.train.recipes import recipe_entry

    recipe_entry("lora_finetune" if lora else "full_finetune")(recipe_config(model, out, args, lora))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_second"] for r in rows if "tokens_per_second" in r]


def worker_transformers(model: Path, args: argparse.Namespace, lora: bool) -> list[float]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ckptkit.train.data import IGNORE_INDEX, TextCompletionDataset, collate, epoch_batches
    from ckptkit.train.tokenizer import load_tokenizer

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = [HF_TARGETS[t] for t in LORA["targets"]]
        config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=targets, lora_dropout=0.0)
        net = get_peft_model(net, config)
    net.train()
    data = TextCompletionDataset(model / "data.txt", load_tokenizer(model), args.seq)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    rates = []
    for indices in epoch_batches(len(data), args.batch, 0, 0)[: args.steps]:
        start = time.perf_counter()
        batch = collate([data[i] for i in indices], 0)
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(int(batch["attention_mask"].sum()) / (time.perf_counter() - start))
    return rates


def measure(kind: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    """Run one worker in a subprocess; its tokens/s and peak RSS."""
    out = work / f"out-{kind}"
    cmd = [sys.executable, __file__, "--worker", kind, "--model", str(model), "--out", str(out),
           "--steps", str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch)]  # fmt: skip
    # Peak RSS from /usr/bin/time: a child started from this (torch-importing) process
    # would otherwise report this process's high-water mark as its own (vfork + exec).
    rss_file = work / f"{kind}.rss"
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed with status {proc.returncode}")
    stdout = proc.stdout
    peak_kb = int(rss_file.read_text().split()[-1])
    rates = json.loads(stdout.strip().splitlines()[-1])[2:]  # drop two warm-up steps
    return {"kind": kind, "tokens_per_s": statistics.median(rates), "peak_rss_mb": peak_kb / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--worker")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        lora = args.worker.endswith("lora")
        if args.worker.startswith("ckptkit"):
            rates = worker_ckptkit(args.model, args.out, args, lora)
        else:
            rates = worker_transformers(args.model, args, lora)
        print(json.dumps(rates))
        return

    import torch

    work = Path(tempfile.mkdtemp(prefix="ckptkit-bench-train-"))
    try:
        params = make_model(work / "model")
        print(f"model: {params / 1e6:.1f}M parameters, float32; batch {args.batch} x seq {args.seq}, "
              f"{args.steps} AdamW steps; torch {torch.__version__}, {os.cpu_count()} CPU cores")  # fmt: skip
        print()
        print("| run | tokens/s | peak RSS | vs transformers |")
        print("| --- | ---: | ---: | ---: |")
        for ours, theirs in (("ckptkit-full", "transformers-full"), ("ckptkit-lora", "transformers-peft-lora")):
            a, b = measure(ours, work / "model", work, args), measure(theirs, work / "model", work, args)
            for r in (b, a):
                ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x"
                print(f"| {r['kind']} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} MB | {ratio} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
