"""Training throughput: ckptkit's recipes vs transformers + PEFT, on CPU or CUDA (torchtune optional).

Cases: ``full`` (full_finetune), ``lora``, ``qlora`` (``quantize_base: nf4``), ``dora``
(``use_dora``), and ``padded`` vs ``packed`` (LoRA on the same instruct documents, each batch
padded to its longest document, or ``dataset.packed`` rows of up to ``--seq`` tokens with the
documents masked from each other). LoRA: rank 8 on q, k, v, o, no dropout.

Each case trains the same model (a Llama written by transformers' ``save_pretrained``) on the
same batches in the same order (ckptkit's data pipeline; every peer collates each batch inside
its clocked step, as the recipe's step does),
with the same fused AdamW at a constant learning rate and the same clipping. ckptkit runs its
own recipe (``ckptkit.train.loop.run``), each optimizer step being the recipe's ``_step``;
the peer is a plain transformers loop, wrapped by PEFT's ``get_peft_model`` for the adapter
cases (``use_dora`` for DoRA). Its QLoRA loads the base through bitsandbytes (NF4, double
quantization, the recipe's dtype for compute); without bitsandbytes the row says n/a.
Packed rows reach transformers as ``position_ids`` restarting per document and no attention
mask, from which it builds the block-diagonal mask itself. With ``--torchtune-python`` the
full and LoRA cases also run torchtune 0.6.1's builders and recipe step.

Each run is its own process under GNU ``time`` (peak RSS, user and system CPU seconds); on
CUDA the worker adds ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``. Each
step is clocked in wall time and process CPU time (CUDA synchronized before each clock read);
the table gives medians after two warm-up steps of tokens/s and of tokens per CPU-second
(the steadier figure on a loaded machine), counting real tokens (padding excluded).
Checkpoint writing is not timed. Rounds interleave the peers, so each ratio compares runs
made under the same load. Every worker prints its first-step loss: ckptkit's and the peer's
must agree in every case (same model, same batch), else the run fails.

Dtype: fp32 on CPU, bf16 weights on CUDA (the recipes' ``dtype: bf16``; adapters float32
on both sides, PEFT's ``autocast_adapter_dtype``).

    python bench/train.py                                   # CPU, tiny shapes, a few minutes
    python bench/train.py --device cuda --scale 8b          # Llama-3-8B-shaped layers (4 of them)
    python bench/train.py --device cuda --scale 8b --layers 32 --rounds 1   # the whole 8B model

torchtune lives in its own virtual environment (``pip install --no-deps torchtune==0.6.1
torchao==0.13.0 omegaconf tiktoken`` over the one with torch): PEFT refuses to run when
torchao older than 0.16 is importable beside it.
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
from typing import Any

from report import reporting

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "hf" / "llama2"  # its tokenizer; vocabulary 384
MODEL = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=384, max_position_embeddings=2048)  # fmt: skip
SHAPES = {  # every decoder linear a multiple of 64 x 256 values (NF4's blocks)
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=384, max_position_embeddings=2048),
    "small": MODEL,
    "8b": dict(hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}  # fmt: skip
DEFAULTS = {"tiny": dict(seq=128, batch=4, steps=10), "small": dict(seq=256, batch=4, steps=8),
            "8b": dict(seq=2048, batch=4, steps=8)}  # fmt: skip
LORA = dict(rank=8, alpha=16, targets=["q", "k", "v", "o"])
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
CASES: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"lora": {}},
    "qlora": {"lora": {"quantize_base": "nf4"}},
    "dora": {"lora": {"use_dora": True}},
    "padded": {"lora": {}, "documents": False},
    "packed": {"lora": {}, "documents": True},
}
"""Each case: the recipe's ``lora`` keys (none: full_finetune) and, for the document cases, packed or not."""
WARMUP = 2  # steps left out of the medians
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-5}
"""Largest first-step loss difference between ckptkit and a peer taken as agreement, by dtype,
where :data:`CASE_TOLERANCE` names no other. On CPU every case is bitwise equal in fp32 (the
bound leaves room for float32 sums in another order) and in bf16 but DoRA and QLoRA; batches
that differ lose differently by over 1e-3, so a bound must stay well below that.
``--loss-tolerance`` replaces every bound (a GPU's kernels may differ more: measure first)."""
CASE_TOLERANCE = {("qlora", "fp32"): 5e-4, ("qlora", "bf16"): 3e-3, ("dora", "bf16"): 5e-4}
"""Measured on CPU: QLoRA's peer quantizes with bitsandbytes, whose double quantization rounds
the scales unlike torchao's (1.3e-4 apart in fp32, 1.7e-3 in bf16, where NF4 itself moves the
loss by about 1e-3); PEFT computes DoRA's norm in another order (1.2e-4 in bf16)."""


def tolerance(case: str, dtype: str, override: float | None = None) -> float:
    """The first-step loss bound of ``case`` in ``dtype`` (``override``: ``--loss-tolerance``)."""
    return override if override is not None else CASE_TOLERANCE.get((case, dtype), TOLERANCE[dtype])


def make_model(path: Path, shape: dict | None = None, repeat: int = 40, bf16: bool = False) -> int:
    """A random Llama of ``shape`` (default MODEL; saved in bf16 with ``bf16``) with the fixture
    tokenizer, and ``data.txt``: the fixture corpus ``repeat`` times. Returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(MODEL if shape is None else shape)
    shape.setdefault("rope_theta", 10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2))
    if bf16:  # half the bytes to write and read at 8B shapes; the runs' dtype anyway
        model.to(torch.bfloat16)
    model.save_pretrained(path)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, path / name)
    corpus = (REPO / "fixtures" / "corpus.txt").read_text().splitlines()
    (path / "data.txt").write_text("\n".join(corpus * repeat) + "\n")
    return model.num_parameters()


def write_documents(path: Path, count: int) -> None:
    """``count`` alpaca-style documents: "Continue the text." and 2 to 16 words of the corpus (varied lengths)."""
    words = (REPO / "fixtures" / "corpus.txt").read_text().split()
    with path.open("w") as f:
        for i in range(count):
            start, n = i * 13 % len(words), 2 + i * 5 % 15
            response = " ".join(words[(start + j) % len(words)] for j in range(n))
            f.write(json.dumps({"instruction": "Continue the text.", "input": "", "output": response}) + "\n")


def prepare(work: Path, args: argparse.Namespace) -> int:
    """The model folder every run reads, with enough text chunks and documents for ``--steps``."""
    shape = dict(SHAPES[args.scale])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], args.seq)
    need = args.steps * args.batch * args.seq
    repeat = need // 800 + 2  # the corpus holds over 1000 tokens
    params = make_model(work / "model", shape, repeat=repeat, bf16=args.dtype == "bf16")
    write_documents(work / "model" / "docs.jsonl", need // 40 + args.steps * args.batch)  # each over 40 tokens
    return params


def dataset_section(model: Path, args: argparse.Namespace, case: str) -> dict:
    """Fixed-length chunks of the corpus, or the instruct documents padded or packed."""
    packed = CASES[case].get("documents")
    if packed is None:
        return {"type": "text", "source": str(model / "data.txt"), "max_seq_len": args.seq}
    return {"type": "instruct", "source": str(model / "docs.jsonl"), "max_seq_len": args.seq, "packed": packed}


def recipe_config(model: Path, out: Path, args: argparse.Namespace, case: str) -> dict:
    cfg = {
        "seed": 0, "device": args.device, "dtype": args.dtype, "quiet": True,
        "checkpointer": {"checkpoint_dir": str(model), "output_dir": str(out)},
        "dataset": dataset_section(model, args, case),
        "epochs": 1, "batch_size": args.batch, "max_steps_per_epoch": args.steps,
        "optimizer": {"lr": 1e-4}, "lr_scheduler": {"warmup_steps": 0, "min_lr_ratio": 1.0},  # constant
        "clip_grad_norm": 1.0, "log_every_n_steps": 1,
    }  # fmt: skip
    if "lora" in CASES[case]:
        cfg["lora"] = dict(LORA, dropout=0.0, save_merged="never", **CASES[case]["lora"])
    return cfg


def bench_batches(model: Path, args: argparse.Namespace, case: str) -> list[list]:
    """The samples of each batch every peer trains on, in order (the recipe's first epoch);
    each peer collates them with ``collate`` inside its clocked step, as the recipe's step does."""
    from ckptkit.train.data import DatasetConfig, build_dataset, epoch_batches
    from ckptkit.train.tokenizer import load_tokenizer

    data = build_dataset(DatasetConfig(**dataset_section(model, args, case)), load_tokenizer(model, 2))
    return [[data[i] for i in b] for b in epoch_batches(len(data), args.batch, 0, 0)[: args.steps]]


def collate(samples: list, device: str) -> dict:
    """One batch as the recipe collates it (pad id 0), on ``device``."""
    from ckptkit.train.data import collate

    return {k: v.to(device) for k, v in collate(samples, 0).items()}


class StepClock:
    """tokens/s of each step in wall time and in CPU time (the process's, all threads); on
    CUDA the device is synchronized before each reading."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, tokens: int) -> None:
        self._sync()
        self.wall.append(tokens / (time.perf_counter() - self._wall))
        self.cpu.append(tokens / (time.process_time() - self._cpu))

    def result(self, first_loss: float, device: str) -> dict:
        """What a worker reports: first loss, per-step rates, CUDA peaks (None on CPU)."""
        import torch

        cuda = device == "cuda"
        return {"loss": first_loss, "wall": self.wall, "cpu": self.cpu,
                "cuda_allocated": torch.cuda.max_memory_allocated() if cuda else None,
                "cuda_reserved": torch.cuda.max_memory_reserved() if cuda else None}  # fmt: skip


def worker_ckptkit(model: Path, out: Path, args: argparse.Namespace, case: str) -> dict:
    """ckptkit's recipe on the case's config, each optimizer step (the recipe's ``_step``) clocked."""
    from ckptkit.train.loop import Recipe, run

    clock, step = StepClock(args.device), Recipe._step

    def timed_step(self, batches):  # the recipe's own step, clocked like the peers' loops
        clock.start()
        loss, tokens = step(self, batches)
        clock.stop(tokens)
        return loss, tokens

    Recipe._step = timed_step  # type: ignore[method-assign]
    try:
        run(recipe_config(model, out, args, case), "full_finetune" if "lora" not in CASES[case] else "lora_finetune")
    finally:
        Recipe._step = step  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return clock.result(next(r["loss"] for r in rows if "loss" in r), args.device)


def worker_transformers(model: Path, args: argparse.Namespace, case: str) -> dict:
    """A transformers loop (+ PEFT for the adapter cases; bitsandbytes NF4 for QLoRA) on the bench's batches."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    load: dict[str, Any] = {"dtype": dtype, "device_map": {"": args.device}}
    if case == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return {"na": "bitsandbytes not installed: pip install bitsandbytes"}
        from transformers import BitsAndBytesConfig

        load["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    net = AutoModelForCausalLM.from_pretrained(model, **load)
    if "lora" in CASES[case]:
        from peft import LoraConfig, get_peft_model

        targets = [HF_TARGETS[t] for t in LORA["targets"]]
        config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=targets, lora_dropout=0.0,
                            use_dora=bool(CASES[case]["lora"].get("use_dora")))  # fmt: skip
        net = get_peft_model(net, config)
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4, fused=True)
    first, clock = None, StepClock(args.device)
    for samples in bench_batches(model, args, case):
        clock.start()
        batch = collate(samples, args.device)
        inputs = {"input_ids": batch["input_ids"]}
        if "position_ids" in batch:  # packed: transformers finds the documents from the restarting positions
            inputs["position_ids"] = batch["position_ids"]
        else:
            inputs["attention_mask"] = batch["attention_mask"]
        logits = net(**inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = first if first is not None else loss.item()
        clock.stop(int(batch["attention_mask"].sum()))
    assert first is not None
    return clock.result(first, args.device)


def worker_torchtune(model: Path, args: argparse.Namespace, case: str) -> dict:
    """torchtune 0.6.1's builders, chunked loss and single-device step (full and LoRA only)."""
    import torch
    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama2 import llama2, lora_llama2
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import scale_grads

    torch.manual_seed(0)
    with (model / "config.json").open() as f:
        hf = json.load(f)
    dims = dict(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                embed_dim=hf["hidden_size"], max_seq_len=hf["max_position_embeddings"],
                intermediate_dim=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"])  # fmt: skip
    lora = case == "lora"
    if lora:
        attn = [{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj"}[t] for t in LORA["targets"]]
        net = lora_llama2(lora_attn_modules=attn, lora_rank=LORA["rank"], lora_alpha=LORA["alpha"], **dims)
    else:
        net = llama2(**dims)
    sd = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    sd = hf_to_tune(sd, num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"], dim=dims["embed_dim"])
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert not unexpected and all("lora" in k for k in missing), (missing, unexpected)
    net.to(device=args.device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    if lora:
        set_trainable_params(net, get_adapter_params(net))
    loss_fn = CEWithChunkedOutputLoss()
    net.set_num_output_chunks(loss_fn.num_output_chunks)
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4, fused=True)
    first, clock = None, StepClock(args.device)
    for samples in bench_batches(model, args, case):
        clock.start()
        batch = collate(samples, args.device)
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
    assert first is not None
    return clock.result(first, args.device)


def run_worker(peer: str, case: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    """One peer's run of one case in this process: first loss, per-step rates, CUDA peaks (or ``na``)."""
    if peer == "ckptkit":
        return worker_ckptkit(model, out, args, case)
    return {"transformers": worker_transformers, "torchtune": worker_torchtune}[peer](model, args, case)


def measure(peer: str, case: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    """One worker in a subprocess under GNU time: its report plus peak RSS and user/sys CPU seconds."""
    out = work / f"out-{peer}-{case}"
    shutil.rmtree(out, ignore_errors=True)
    python = args.torchtune_python if peer == "torchtune" else sys.executable
    cmd = [python, __file__, "--worker", peer, "--case", case, "--model", str(model), "--out", str(out),
           "--device", args.device, "--dtype", args.dtype,
           "--steps", str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch)]  # fmt: skip
    # GNU time, not os.wait4: a child started from this (torch-importing) process would
    # otherwise report this process's high-water mark as its own (vfork + exec).
    stats = work / f"{peer}-{case}.time"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # waiting threads sleep: no CPU burnt spinning
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M %U %S", "-o", str(stats), *cmd], stdout=subprocess.PIPE, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"{peer} {case} failed with status {proc.returncode}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if "na" in got:
        return got
    peak_kb, user, system = stats.read_text().split()[-3:]
    got.update(tokens_per_s=statistics.median(got["wall"][WARMUP:]),
               tokens_per_cpu_s=statistics.median(got["cpu"][WARMUP:]),
               peak_rss_mb=int(peak_kb) / 1024, user_s=float(user), sys_s=float(system))  # fmt: skip
    return got


def disagreements(results: dict[tuple[str, str], list[dict]], dtype: str, override: float | None = None) -> list[str]:
    """Cases whose peers' first-step losses differ from ckptkit's by more than the tolerance."""
    bad = []
    for (peer, case), runs in results.items():
        if peer == "ckptkit" or "na" in runs[0]:
            continue
        ours, theirs = results["ckptkit", case][0]["loss"], runs[0]["loss"]
        tol = tolerance(case, dtype, override)
        if abs(ours - theirs) > tol:
            bad.append(f"{case}: ckptkit {ours:.7f}, {peer} {theirs:.7f} (|diff| {abs(ours - theirs):.2e} > {tol:g})")
    return bad


def peers(case: str, args: argparse.Namespace) -> list[str]:
    torchtune = args.torchtune_python is not None and case in ("full", "lora")
    return ["ckptkit", "transformers", *(["torchtune"] if torchtune else [])]


def table(results: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> None:
    """One row per case and peer: rates per round and their ratio to ckptkit's, memory, first loss."""
    cuda = args.device == "cuda"
    memory = "peak allocated / reserved (GiB)" if cuda else "peak RSS"
    print(f"| case | peer | tokens/s (rounds) | ckptkit / peer | tokens per CPU-s (rounds) | ckptkit / peer | {memory} "
          "| user s | sys s | loss 1 | loss 1 - ckptkit's |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for case in args.cases:
        ours = results["ckptkit", case]
        for peer in peers(case, args):
            runs = results[peer, case]
            name = {"transformers": "transformers + PEFT" if "lora" in CASES[case] else "transformers"}.get(peer, peer)
            if "na" in runs[0]:
                print(f"| {case} | {name} | n/a ({runs[0]['na']}) | | | | | | | | |")
                continue
            cells = []
            for key in ("tokens_per_s", "tokens_per_cpu_s"):
                ratios = [o[key] / x[key] for o, x in zip(ours, runs, strict=True)]
                cells += [" / ".join(f"{x[key]:.0f}" for x in runs), " / ".join(f"{r:.2f}x" for r in ratios)]
            if cuda:
                mem = f"{statistics.median(x['cuda_allocated'] for x in runs) / 2**30:.2f} / " \
                      f"{statistics.median(x['cuda_reserved'] for x in runs) / 2**30:.2f}"  # fmt: skip
            else:
                mem = f"{statistics.median(x['peak_rss_mb'] for x in runs):.0f} MB"
            diff = "" if peer == "ckptkit" else f"{runs[0]['loss'] - ours[0]['loss']:+.1e}"
            user, system = (statistics.median(x[k] for x in runs) for k in ("user_s", "sys_s"))
            print(f"| {case} | {name} | {' | '.join(cells)} | {mem} | {user:.1f} | {system:.1f} | "
                  f"{runs[0]['loss']:.6f} | {diff} |")  # fmt: skip


def packing_ratios(results: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> None:
    """tokens/s packed over padded, per peer and round."""
    if not {"packed", "padded"} <= set(args.cases):
        return
    for peer in peers("packed", args):
        ratios = [
            p["tokens_per_s"] / q["tokens_per_s"]
            for p, q in zip(results[peer, "packed"], results[peer, "padded"], strict=True)
        ]
        print(f"packed / padded tokens/s, {peer}: {' / '.join(f'{r:.2f}x' for r in ratios)}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--scale", default="tiny", choices=list(SHAPES), help="model shapes (8b: Llama 3 8B's layers)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the scale's; 8b: 4 of 32)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run ({WARMUP} warm-up); default by scale")
    parser.add_argument("--seq", type=int, help="tokens per row (max_seq_len); default by scale")
    parser.add_argument("--batch", type=int, help="rows per step; default by scale")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run on CPU (1: steadier when shared)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every run")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--loss-tolerance", type=float, help="first-step loss bound, every case (default: as measured on CPU)"
    )
    parser.add_argument(
        "--torchtune-python", help="a Python with torchtune 0.6.1 + torchao 0.13.0: adds it to full, lora"
    )
    parser.add_argument("--worker", choices=["ckptkit", "transformers", "torchtune"], help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.scale].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.steps <= WARMUP:
        parser.error(f"--steps must be over {WARMUP} (the warm-up steps)")
    return args


def main() -> None:
    args = parse()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.case, args.model, args.out, args)))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device here; run on CPU or on a GPU")
    if args.torchtune_python and SHAPES[args.scale].get("rope_theta", 10000.0) != 10000.0:
        raise SystemExit("--torchtune-python: its llama2 builders have RoPE base 10000; use --scale tiny or small")
    import peft
    import transformers

    try:
        import bitsandbytes

        bnb = f"bitsandbytes {bitsandbytes.__version__}"
    except ImportError:
        bnb = "no bitsandbytes"
    work = Path(tempfile.mkdtemp(prefix="ckptkit-bench-train-"))
    try:
        params = prepare(work, args)
        gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
        threads = f" ({args.threads} torch thread{'s' if args.threads > 1 else ''} per run)" if not gpu else ""
        print(f"model: {args.scale} shapes, {params / 1e6:.1f}M parameters, {args.dtype}; batch {args.batch} x seq "
              f"{args.seq}, {args.steps} AdamW steps ({WARMUP} warm-up), {args.rounds} interleaved rounds; device "
              f"{args.device}{gpu}{threads}; torch {torch.__version__}, transformers {transformers.__version__}, peft "
              f"{peft.__version__}, {bnb}; {os.cpu_count()} CPU cores, "
              f"load average before {os.getloadavg()[0]:.1f}")  # fmt: skip
        results: dict[tuple[str, str], list[dict]] = {(p, c): [] for c in args.cases for p in peers(c, args)}
        for r in range(args.rounds):
            for case in args.cases:
                kinds = peers(case, args)
                for peer in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotate who runs first
                    results[peer, case].append(measure(peer, case, work / "model", work, args))
        print()
        table(results, args)
        print()
        packing_ratios(results, args)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        bad = disagreements(results, args.dtype, args.loss_tolerance)
        if bad:
            raise SystemExit("first-step losses disagree: " + "; ".join(bad))
        bounds = {case: tolerance(case, args.dtype, args.loss_tolerance) for case in args.cases}
        tol = ", ".join(f"{case} {bound:g}" for case, bound in bounds.items())
        print(f"first-step losses: every peer within {tol} of ckptkit's")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    with reporting("train.py"):
        main()
