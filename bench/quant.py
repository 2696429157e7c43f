"""Benchmark dequantizing a block-FP8 checkpoint: ``ckptkit convert`` to bf16 HF and to bf16
GGUF against a durable ``dd`` of the output's size, llama.cpp's converter and DeepSeek's
``fp8_cast_bf16.py`` run on the CPU, in the same rounds, until on disk.

The source is a synthetic HF folder of ``--layers`` decoder layers (default 4) of Llama-3-8B's
shapes (hidden 4096, intermediate 14336, 32 heads over 8 KV heads), every linear weight
quantized by the published formula (``scale_inv = amax / 448`` per 128 x 128 block, e4m3),
float32 ``weight_scale_inv``, DeepSeek's ``quantization_config``, bf16 norms, with the
fixtures' tiny Llama 3 style tokenizer (384 tokens, so the layers are what is timed; its
pre-tokenizer given to both GGUF writers as ``llama-bpe``), one shard per layer and an index,
as releases ship. Interleaved rounds (``--repeat``, default 3; the order rotates every round)
warm the source, then time each command as its own process under GNU ``time`` (wall, peak
RSS) followed by a timed ``sync``; the Python tools run from compiled bytecode (compiled
first, as an installed package is):

* ``ckptkit convert SRC OUT --to hf --dtype bfloat16`` (each weight read, dequantized and
  written a few MiB at a time, while the next few are made, without torch, written past the
  page cache from the buffers the pieces are made in);
* ``ckptkit convert BF16 OUT --to hf`` of a bf16 copy of the source (ckptkit's own output,
  made once): ckptkit writing the same output bytes without dequantizing, what the
  dequantizing write is measured against inside ckptkit, as ``auto`` copies it (through the
  page cache under the kernel's dirty limit) and with ``--copy-method direct``;
* ``ckptkit convert SRC OUT.gguf --to gguf --dtype bfloat16``;
* llama.cpp's ``convert_hf_to_gguf.py SRC --outtype bf16`` (llama-cpp-python 0.3.36, the
  tests' copy), which dequantizes FP8 sources itself;
* with ``--deepseek-script PATH``, DeepSeek-V3's ``inference/fp8_cast_bf16.py``, unmodified,
  run by ``bench/fp8_cast_cpu.py`` (a plain torch stand-in for its Triton ``weight_dequant``,
  the same recipe, and files loaded to the CPU instead of CUDA);
* ``dd`` of a file of the bf16 output's weight bytes past the page cache, fsynced;
* the first command on the tiny FP8 fixture ``fixtures/fp8/llama-overhang``: what any
  ckptkit command pays before and after its bytes (imports, planning, numba's first call,
  publishing), so that the report can also give the big write less that start over dd.

In the last round the outputs are compared: ckptkit's HF tensors with DeepSeek's script's,
ckptkit's GGUF with llama.cpp's (sha256 of each tensor). Medians, each round, GiB/s of bf16
output, CPU seconds (user + system), peak RSS and the 1-minute load average (the machine is shared). Run::

    python bench/quant.py [--layers 4] [--repeat 3] [--deepseek-script PATH]
        [--out bench/out/quant] [--report docs/bench/quant.md]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "formats"))

from convert import Run, durable_copy, remove, timed, warm  # noqa: E402
from gguf_quantize import digest  # noqa: E402  (takes this folder off sys.path: ``import gguf`` is the package)
from report import reporting  # noqa: E402

GB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "fp8" / "llama-overhang"  # the fixed start: imports, planning, numba's first call
HIDDEN, INTER, KV, VOCAB = 4096, 14336, 1024, 384
PRE = "llama-bpe"  # the fixture tokenizer's pre-tokenizer: llama.cpp cannot know its hash
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
SHAPES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}  # fmt: skip
GET_IT = (
    "DeepSeek's fp8_cast_bf16.py: not run (get it with `git clone https://github.com/deepseek-ai/DeepSeek-V3` and "
    "pass --deepseek-script DeepSeek-V3/inference/fp8_cast_bf16.py)"
)


def build(root: Path, layers: int) -> tuple[Path, int]:
    """The synthetic FP8 source (built once, kept between runs) and its bf16 weight bytes."""
    import torch
    from safetensors.torch import save_file

    from ckptkit.quant.fp8 import BlockFP8

    src = root / f"src-{layers}"
    per_layer = 2 * HIDDEN + sum(a * b for a, b in SHAPES.values())
    bf16_bytes = 2 * (2 * VOCAB * HIDDEN + HIDDEN + layers * per_layer)
    if (src / "config.json").exists():
        return src, bf16_bytes
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    method = BlockFP8(CONFIG, src)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [
        {
            "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16) * 0.02,
            "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16) * 0.02,
            "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }
    ]
    for i in range(layers):
        norms = ("input_layernorm", "post_attention_layernorm")
        shard = {f"model.layers.{i}.{n}.weight": torch.ones(HIDDEN, dtype=torch.bfloat16) for n in norms}
        for name, shape in SHAPES.items():
            q, s = method.quantize(torch.randn(shape, generator=gen) * 0.02)
            shard[f"model.layers.{i}.{name}.weight"] = q
            shard[f"model.layers.{i}.{name}.weight_scale_inv"] = s
        shards.append(shard)
    weight_map = {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, src / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    index = {"metadata": {}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 372, "eos_token_id": 373, "quantization_config": CONFIG,
    }  # fmt: skip
    (src / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in (ROOT / "fixtures" / "hf" / "llama3").glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    return src, bf16_bytes


def bf16_copy(src: Path) -> Path:
    """The source dequantized to bf16 by ckptkit (made once, kept beside it): the bf16
    checkpoint of the same output bytes, for ckptkit's plain write of them."""
    from ckptkit.convert import ConvertOptions, convert

    out = src.parent / f"{src.name}-bf16"
    if not (out / "config.json").exists():
        remove(out)
        convert(src, out, ConvertOptions("hf", dtype="bfloat16"))
    return out


def same_safetensors(a: Path, b: Path) -> bool:
    """The same tensor names, dtypes and bytes in the ``*.safetensors`` of two folders."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, tuple[Path, torch.dtype]]:
        out = {}
        for p in sorted(folder.glob("*.safetensors")):
            with safe_open(p, "pt") as f:
                out |= {k: (p, f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
        return out

    ta, tb = tensors(a), tensors(b)
    if sorted(ta) != sorted(tb) or any(ta[k][1] != tb[k][1] for k in ta):
        return False
    for k in ta:
        with safe_open(ta[k][0], "pt") as fa, safe_open(tb[k][0], "pt") as fb:
            if not torch.equal(fa.get_tensor(k).view(torch.uint8), fb.get_tensor(k).view(torch.uint8)):
                return False
    return True


def on_disk(run: Run) -> float:
    return run.wall_s + (run.sync_s or 0)


def main(argv: list[str] | None = None) -> int:
    from test_gguf import CONVERTER

    from tokenizer_helpers import llama_cpp_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--deepseek-script", type=Path, help="DeepSeek-V3's inference/fp8_cast_bf16.py")
    parser.add_argument("--out", type=Path, default=Path("bench/out/quant"))
    args = parser.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src, size = build(work, args.layers)
    bf16 = bf16_copy(src)
    llama_cpp = llama_cpp_dir()
    # every Python tool runs from bytecode compiled once, as installed packages do (an
    # environment that writes none would have each run compile ckptkit's and gguf-py's modules)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for tree in (ROOT / "ckptkit", llama_cpp / "gguf-py", llama_cpp / "conversion", llama_cpp):
        if tree.exists():
            compileall.compile_dir(tree, maxlevels=0 if tree == llama_cpp else 10, quiet=1)
    blob = work / "blob"
    if not blob.exists() or blob.stat().st_size != size:
        with blob.open("wb") as f:
            f.truncate(size)
    outs = {"hf": work / "ckptkit-hf", "hf-bf16": work / "ckptkit-hf-bf16", "gguf": work / "ckptkit.gguf"}
    outs["hf-bf16-direct"] = work / "ckptkit-hf-bf16-direct"
    outs["start"] = work / "ckptkit-start"
    outs["llama.cpp"] = work / "llama-cpp.gguf"
    outs |= {"deepseek": work / "deepseek", "dd": work / "dd.out"}
    ckptkit = [sys.executable, "-m", "ckptkit", "convert", str(src)]
    env = f"PYTHONPATH={llama_cpp / 'gguf-py'}"
    commands = {
        "hf": [*ckptkit, str(outs["hf"]), "--to", "hf", "--dtype", "bfloat16", "--quiet"],
        "hf-bf16": [*ckptkit[:-1], str(bf16), str(outs["hf-bf16"]), "--to", "hf", "--quiet"],
        "hf-bf16-direct": [*ckptkit[:-1], str(bf16), str(outs["hf-bf16-direct"]), "--to", "hf", "--quiet"]
        + ["--copy-method", "direct"],
        "gguf": [*ckptkit, str(outs["gguf"]), "--to", "gguf", "--dtype", "bfloat16", "--gguf-pre", PRE, "--quiet"],
        "start": [*ckptkit[:-1], str(TINY), str(outs["start"]), "--to", "hf", "--dtype", "bfloat16", "--quiet"],
        "llama.cpp": ["env", env, sys.executable, "-c", CONVERTER, str(src), PRE, str(outs["llama.cpp"]), "bf16"],
        "dd": durable_copy(blob, outs["dd"]),
    }
    if args.deepseek_script:
        script = args.deepseek_script.resolve()
        if not script.is_file():
            raise SystemExit(f"--deepseek-script {script}: no such file")
        commands["deepseek"] = [sys.executable, str(ROOT / "bench" / "fp8_cast_cpu.py"), str(script)]
        commands["deepseek"] += ["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(outs["deepseek"])]
    names = list(commands)
    src_gib = sum(p.stat().st_size for p in src.glob("*.safetensors")) / GB
    print(
        f"FP8 source: {args.layers} layer(s) of Llama-3-8B shapes, 128x128 blocks, float32 weight_scale_inv, "
        f"vocab {VOCAB}: {src_gib:.2f} GiB -> bf16 {size / GB:.2f} GiB; {args.repeat} rounds, order rotated"
    )
    if not args.deepseek_script:
        print(GET_IT)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    load = [os.getloadavg()[0]]
    same: dict[str, bool] = {}
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            remove(outs[name])
            warm(
                [blob]
                if name == "dd"
                else [bf16]
                if name.startswith("hf-bf16")
                else [TINY]
                if name == "start"
                else [src]
            )
            cwd = llama_cpp if name == "llama.cpp" else None
            runs[name].append(timed(commands[name], work / f"{name}-{r}.log", cwd))
            if r < args.repeat - 1 or name == "dd":
                remove(outs[name])
        if r == args.repeat - 1:
            same["gguf"] = digest(outs["gguf"]) == digest(outs["llama.cpp"])
            same["hf-bf16"] = same_safetensors(outs["hf"], outs["hf-bf16"])
            same["hf-bf16"] &= same_safetensors(outs["hf"], outs["hf-bf16-direct"])
            if "deepseek" in outs and outs["deepseek"].exists():
                same["deepseek"] = same_safetensors(outs["hf"], outs["deepseek"])
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} {on_disk(runs[n][-1]):.1f} s" for n in names), flush=True)
    for out in outs.values():
        remove(out)
    print(f"load average (1 min) before and after each round: {', '.join(f'{x:.1f}' for x in load)}")
    print(f"ckptkit's GGUF tensors identical to llama.cpp's: {'yes' if same['gguf'] else 'NO'}")
    baseline = "yes" if same["hf-bf16"] else "NO"  # like for like (its source is ckptkit's own dequantization)
    print(f"the bf16 baselines write the dequantizing write's tensors (same output): {baseline}")
    if "deepseek" in same:
        print(f"ckptkit's HF tensors identical to DeepSeek's script's: {'yes' if same['deepseek'] else 'NO'}")
    labels = {
        "hf": "ckptkit convert --to hf --dtype bfloat16",
        "hf-bf16": "ckptkit convert --to hf, bf16 source",
        "hf-bf16-direct": "ckptkit convert --to hf, bf16 source, direct",
        "gguf": "ckptkit convert --to gguf --dtype bfloat16",
        "llama.cpp": "convert_hf_to_gguf.py --outtype bf16",
        "deepseek": "DeepSeek fp8_cast_bf16.py (CPU stand-in)",
        "dd": "dd oflag=direct conv=fsync, output's size",
        "start": "the first, of the tiny FP8 fixture (2 layers)",
    }
    print(f"\n{'command':<44} {'until on disk s':>15} {'GiB/s':>6} {'CPU s':>6} {'peak RSS':>10}  each round (s)")
    for name in names:
        disk = statistics.median(on_disk(x) for x in runs[name])
        rss = statistics.median(x.peak_rss for x in runs[name]) / (1 << 20)
        cpu = statistics.median(x.user_s + x.sys_s for x in runs[name])
        each = ", ".join(f"{on_disk(x):.1f}" for x in runs[name])
        rate = "-" if name == "start" else f"{size / GB / disk:.2f}"
        print(f"{labels[name]:<44} {disk:>15.1f} {rate:>6} {cpu:>6.1f} {rss:>6.0f} MiB  {each}")
    print()
    for name in names:
        if name not in ("dd", "start"):
            ratio = [on_disk(a) / on_disk(b) for a, b in zip(runs[name], runs["dd"], strict=True)]
            print(f"{labels[name]} / dd, per round: {', '.join(f'{x:.2f}x' for x in ratio)}")
    each = zip(runs["hf"], runs["start"], runs["dd"], strict=True)  # the bytes' cost past the start the command pays
    ratio = [(on_disk(a) - on_disk(s)) / on_disk(b) for a, s, b in each]
    print(f"{labels['hf']}, less the tiny source's time, / dd, per round: {', '.join(f'{x:.2f}x' for x in ratio)}")
    for base in ("hf-bf16", "hf-bf16-direct"):
        ratio = [on_disk(a) / on_disk(b) for a, b in zip(runs["hf"], runs[base], strict=True)]
        cpu = [(a.user_s + a.sys_s) / (b.user_s + b.sys_s) for a, b in zip(runs["hf"], runs[base], strict=True)]
        print(f"{labels['hf']} / {labels[base]}, per round: {', '.join(f'{x:.2f}x' for x in ratio)} until on disk,")
        print(f"  {', '.join(f'{x:.2f}x' for x in cpu)} CPU s")
    return 0


if __name__ == "__main__":
    with reporting("quant.py"):
        code = main()
    sys.exit(code)
