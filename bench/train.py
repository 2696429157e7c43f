"""Training throughput: ckptkit's recipes vs torchtune 0.6.1 and a transformers (+ PEFT) loop, on CPU.

Same model (an 18M-parameter Llama written by transformers' save_pretrained), same data
(the fixture corpus repeated, tokenised by the fixture tokenizer into fixed-length chunks),
same batches in the same order, same AdamW (fused) and clipping, float32. torchtune runs
its own model builders (``llama2`` / ``lora_llama2``), its chunked cross-entropy and the
step of its single-device recipes (token-weighted loss, ``scale_grads``). Each run is its
own subprocess under GNU ``time`` (peak RSS, user and system CPU seconds). Each optimizer step
(ckptkit: the recipe's own ``_step``) is clocked in wall time and in process CPU time; the
table gives the median after two warm-up steps of tokens/s and of tokens per CPU-second
(the steadier figure on a loaded machine). Checkpoint writing is not timed.
Rounds interleave the peers, so each ratio compares runs made under the same load; every
worker prints its first-step loss, which must agree across peers (same model, same batch).

    python bench/train.py                  # defaults below, prints a markdown table
    python bench/train.py --steps 20 --seq 256 --batch 4 --rounds 3 --torchtune-python /path/to/venv/bin/python

torchtune lives in its own virtual environment (``pip install --no-deps torchtune==0.6.1
torchao==0.13.0 omegaconf tiktoken`` over the one with torch 2.13.0): PEFT refuses to run
when torchao older than 0.16 is importable beside it.
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

from report import reporting

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


class StepClock:
    """tokens/s of each step in wall time and in CPU time (the process's, all threads)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, tokens: int) -> None:
        self.wall.append(tokens / (time.perf_counter() - self._wall))
        self.cpu.append(tokens / (time.process_time() - self._cpu))


def worker_ckptkit(model: Path, out: Path, args: argparse.Namespace, lora: bool) -> tuple[float, StepClock]:
    from ckptkit.train.loop import Recipe, run

    clock, step = StepClock(), Recipe._step

    def timed_step(self, batches):  # the recipe's own step, clocked like the peers' loops
        clock.start()
        loss, tokens = step(self, batches)
        clock.stop(tokens)
        return loss, tokens

    Recipe._step = timed_step  # type: ignore[method-assign]
    try:
        run(recipe_config(model, out, args, lora), "lora_finetune" if lora else "full_finetune")
    finally:
        Recipe._step = step  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in rows if "loss" in r), clock


def bench_batches(model: Path, args: argparse.Namespace) -> list[dict]:
    """The collated batches every peer trains on, in order."""
    from ckptkit.train.data import DatasetConfig, build_dataset, collate, epoch_batches
    from ckptkit.train.tokenizer import load_tokenizer

    cfg = DatasetConfig(type="text", source=str(model / "data.txt"), max_seq_len=args.seq)
    data = build_dataset(cfg, load_tokenizer(model))
    return [collate([data[i] for i in b], 0) for b in epoch_batches(len(data), args.batch, 0, 0)[: args.steps]]


def worker_torchtune(model: Path, args: argparse.Namespace, lora: bool) -> tuple[float, StepClock]:
    import torch
    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama2 import llama2, lora_llama2
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import scale_grads

    torch.manual_seed(0)
    dims = dict(vocab_size=MODEL["vocab_size"], num_layers=MODEL["num_hidden_layers"],
                num_heads=MODEL["num_attention_heads"], num_kv_heads=MODEL["num_key_value_heads"],
                embed_dim=MODEL["hidden_size"], max_seq_len=MODEL["max_position_embeddings"],
                intermediate_dim=MODEL["intermediate_size"], norm_eps=1e-6)  # fmt: skip
    if lora:
        attn = [{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj"}[t] for t in LORA["targets"]]
        net = lora_llama2(lora_attn_modules=attn, lora_rank=LORA["rank"], lora_alpha=LORA["alpha"], **dims)
    else:
        net = llama2(**dims)
    sd = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    sd = hf_to_tune(sd, num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"], dim=dims["embed_dim"])
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert not unexpected and all("lora" in k for k in missing), (missing, unexpected)
    if lora:
        set_trainable_params(net, get_adapter_params(net))
    loss_fn = CEWithChunkedOutputLoss()
    net.set_num_output_chunks(loss_fn.num_output_chunks)
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4, fused=True)
    first, clock = None, StepClock()
    for batch in bench_batches(model, args):
        clock.start()
        labels = batch["labels"]  # already shifted, like torchtune's hstack of labels[..., 1:]
        num_tokens = (labels != -100).sum()
        loss = loss_fn(net(batch["input_ids"]), labels) * num_tokens
        loss.backward()
        scale_grads(net, 1 / num_tokens)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = first if first is not None else loss.item() / int(num_tokens)
        clock.stop(int(batch["attention_mask"].sum()))
    return first, clock


def worker_transformers(model: Path, args: argparse.Namespace, lora: bool) -> tuple[float, StepClock]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = [HF_TARGETS[t] for t in LORA["targets"]]
        config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=targets, lora_dropout=0.0)
        net = get_peft_model(net, config)
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4, fused=True)
    first, clock = None, StepClock()
    for batch in bench_batches(model, args):
        clock.start()
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = first if first is not None else loss.item()
        clock.stop(int(batch["attention_mask"].sum()))
    return first, clock


def measure(kind: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    """Run one worker in a subprocess under GNU time: tokens/s, first loss, peak RSS, user/sys CPU."""
    out = work / f"out-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    python = args.torchtune_python if kind.startswith("torchtune") else sys.executable
    cmd = [python, __file__, "--worker", kind, "--model", str(model), "--out", str(out),
           "--steps", str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch)]  # fmt: skip
    # GNU time, not os.wait4: a child started from this (torch-importing) process would
    # otherwise report this process's high-water mark as its own (vfork + exec).
    stats = work / f"{kind}.time"
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M %U %S", "-o", str(stats), *cmd], stdout=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed with status {proc.returncode}")
    peak_kb, user, system = stats.read_text().split()[-3:]
    first, wall, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"kind": kind, "tokens_per_s": statistics.median(wall[2:]), "loss": first,  # two warm-up steps dropped
            "tokens_per_cpu_s": statistics.median(cpu[2:]),
            "peak_rss_mb": int(peak_kb) / 1024, "user_s": float(user), "sys_s": float(system)}  # fmt: skip


PEERS = {"full": ["ckptkit-full", "torchtune-full", "transformers-full"],
         "lora": ["ckptkit-lora", "torchtune-lora", "transformers-peft-lora"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every run")
    parser.add_argument(
        "--torchtune-python",
        default=sys.executable,
        help="a Python with torchtune 0.6.1 + torchao 0.13.0 (PEFT refuses torchao < 0.16 beside it)",
    )
    parser.add_argument("--worker")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        lora = args.worker.endswith("lora")
        workers = {"ckptkit": lambda: worker_ckptkit(args.model, args.out, args, lora),
                   "torchtune": lambda: worker_torchtune(args.model, args, lora),
                   "transformers": lambda: worker_transformers(args.model, args, lora)}  # fmt: skip
        first, clock = workers[args.worker.split("-")[0]]()
        print(json.dumps([first, clock.wall, clock.cpu]))
        return

    import torch

    work = Path(tempfile.mkdtemp(prefix="ckptkit-bench-train-"))
    try:
        params = make_model(work / "model")
        print(f"model: {params / 1e6:.1f}M parameters, float32; batch {args.batch} x seq {args.seq}, "
              f"{args.steps} AdamW steps, {args.rounds} interleaved rounds; torch {torch.__version__}, "
              f"{os.cpu_count()} CPU cores, load average before {os.getloadavg()[0]:.1f}")  # fmt: skip
        results: dict[str, list[dict]] = {k: [] for kinds in PEERS.values() for k in kinds}
        for r in range(args.rounds):
            for kinds in PEERS.values():
                order = kinds[r % 3 :] + kinds[: r % 3]  # rotate who runs first
                for kind in order:
                    results[kind].append(measure(kind, work / "model", work, args))
        print()
        print("| run | tokens/s wall (rounds) | ckptkit / peer | tokens per CPU-s (rounds) | ckptkit / peer | "
              "peak RSS | user s | sys s | loss 1 |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
        for kinds in PEERS.values():
            ours = results[kinds[0]]
            for kind in kinds:
                runs = results[kind]
                cells = []
                for key in ("tokens_per_s", "tokens_per_cpu_s"):
                    ratios = [o[key] / x[key] for o, x in zip(ours, runs, strict=True)]
                    cells += [" / ".join(f"{x[key]:.0f}" for x in runs), " / ".join(f"{r:.2f}x" for r in ratios)]
                print(f"| {kind} | {' | '.join(cells)} | {statistics.median(x['peak_rss_mb'] for x in runs):.0f} MB | "
                      f"{statistics.median(x['user_s'] for x in runs):.1f} | "
                      f"{statistics.median(x['sys_s'] for x in runs):.1f} | {runs[0]['loss']:.6f} |")  # fmt: skip
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    with reporting("train.py"):
        main()
