"""Benchmark converting the new families per byte: a deepseek_v3-shaped and a qwen3_5_moe-shaped
HF checkpoint, and a Llama-shaped one of about their size, to hf-bin, internal, DCP and GGUF,
against ``cp -r`` + sync, a durable ``dd`` and llama.cpp's converter, same rounds, until on disk.

Each source is built once by transformers itself (``from_config`` from the bundled fixture's
config with real-model widths scaled down so that a round takes seconds, not minutes, on two
CPUs; ``save_pretrained`` in bf16, 200 MB shards) with that fixture's tiny tokenizer (384
tokens, so the layers are what is timed; its pre-tokenizer given to both GGUF writers):

* ``deepseek_v3``: hidden 2048 (real: 7168), 16 heads (128) with the real MLA widths
  (``q_lora_rank`` 1536, ``kv_lora_rank`` 512, head dims 128 + 64 rope, values 128), one
  dense layer (intermediate 5632) then two MoE layers of 32 routed experts (256) of width 512
  (2048), one shared expert, per-expert tensors as the release stores them;
* ``qwen3_5_moe``: hidden 2048, three Gated DeltaNet layers (16 key / 32 value heads of 128)
  then one gated full-attention layer (16 heads, 2 KV, head 256), 16 experts (real: 256) of
  width 512, packed in 3-D tensors as the release stores them, and a shared expert of 512;
* ``llama``: hidden 2048, 16 heads / 4 KV, intermediate 5632, as many layers as make it the
  mean size of the other two.

Qwen's MTP layer (which llama.cpp's ``qwen35moe`` requires) is added as random tensors shaped like
the last layer's; DeepSeek's is left out (llama.cpp skips it; transformers builds neither). Interleaved
rounds (``--repeat``, default 2): for each command (the order rotates every round), each model
in turn (rotated too), so that the same command on two models runs under the same load. Each
command is its own process under GNU ``time`` (wall, CPU, peak RSS) after an untimed read of
its source, then a timed ``sync``: "until on disk". Commands:

* ``ckptkit convert SRC OUT --to hf-bin | internal | dcp``, and ``--to gguf --dtype bfloat16``;
* llama.cpp's ``convert_hf_to_gguf.py SRC --outtype bf16`` (llama-cpp-python 0.3.36, the tests' copy);
* ``cp -r SRC`` and ``dd`` of a file of the source's weight bytes past the page cache, fsynced.

In the last round each ckptkit GGUF is compared with llama.cpp's (sha256 of each tensor). The
report gives, per model and command, the median until on disk, MB/s of source weights, CPU
seconds and peak RSS, and per family and command its MB/s over the Llama model's in the same
round (1.00x: as fast per byte); the 1-minute load average before each round. Run::

    python bench/families.py [--repeat 2] [--out bench/out/families] [--report docs/bench/families.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "formats"))

from convert import Run, durable_copy, remove, timed, warm  # noqa: E402
from gguf_quantize import digest  # noqa: E402  (takes this folder off sys.path: ``import gguf`` is the package)
from report import reporting  # noqa: E402

MB = 1_000_000
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "hf"
DEEPSEEK_V3 = {
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "qk_head_dim": 192, "head_dim": 64,
    "v_head_dim": 128, "intermediate_size": 5632, "moe_intermediate_size": 512, "n_routed_experts": 32,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
}  # fmt: skip
QWEN3_5_MOE = {
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mtp_num_hidden_layers": 1,
}  # fmt: skip
LLAMA = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
         "intermediate_size": 5632}  # fmt: skip
# model -> (fixture whose config and tokenizer it starts from, overrides, llama.cpp pre-tokenizer name)
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3, "llama-bpe"),
    "qwen3_5_moe": ("qwen3_5_moe", QWEN3_5_MOE, "qwen2"),
    "llama": ("llama3", LLAMA, "llama-bpe"),
}
PACKED = {"qwen3_5_moe"}  # experts saved as 3-D stacks, as Qwen's releases (and the fixture) store them
TARGETS = ("hf-bin", "internal", "dcp", "gguf")


def build(root: Path, model: str, layers: int | None = None) -> Path:
    """The model's HF folder made by transformers (seeded; built once, kept between runs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fixture, overrides, _ = MODELS[model]
    out = root / (model if layers is None else f"{model}-{layers}")
    if (out / "model.safetensors.index.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = json.loads((FIXTURES / fixture / "config.json").read_text()) | overrides
    if layers is not None:
        config["num_hidden_layers"] = layers
    if "rope_parameters" in config and "mrope_section" in config["rope_parameters"]:
        rotary = int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"]) // 2
        config["rope_parameters"]["mrope_section"] = [rotary - 2 * (rotary // 3), rotary // 3, rotary // 3]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    net.save_pretrained(out, max_shard_size="200MB", save_original_format=model not in PACKED)
    del net
    if config.get("mtp_num_hidden_layers"):
        add_mtp(out, config)
    for f in (FIXTURES / fixture).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def add_mtp(out: Path, config: dict[str, Any]) -> None:
    """Qwen's MTP layer (transformers builds none): random tensors shaped like the last
    (full-attention) layer's, as ``mtp.layers.0.*``, plus ``mtp.fc`` and its norms, in the
    last shard."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from synthetic import random_tensor

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    layer = f"model.layers.{config['num_hidden_layers'] - 1}."
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    norms = ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    mtp = {f"mtp.{n}.weight": random_tensor((hidden,), gen) for n in norms}
    mtp["mtp.fc.weight"] = random_tensor((hidden, 2 * hidden), gen)
    for name, file in index["weight_map"].items():
        if name.startswith(layer):
            with safe_open(out / file, "pt") as f:
                like = f.get_slice(name)
                shape, dtype = tuple(like.get_shape()), like.get_dtype()
            mtp["mtp.layers.0." + name.removeprefix(layer)] = random_tensor(shape, gen).to(dtypes[dtype])
    last = sorted(set(index["weight_map"].values()))[-1]
    save_file(load_file(out / last) | mtp, out / last, metadata={"format": "pt"})
    index["weight_map"] |= dict.fromkeys(mtp, last)
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp.values())
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def build_all(root: Path) -> dict[str, Path]:
    """The two families, then a Llama of about their mean size (its layer count from a 1- and
    a 2-layer build)."""
    sources = {m: build(root, m) for m in ("deepseek_v3", "qwen3_5_moe")}
    target = statistics.mean(weight_bytes(p) for p in sources.values())
    one, two = (weight_bytes(build(root / "sizing", "llama", n)) for n in (1, 2))
    layers = max(1, round((target - (2 * one - two)) / (two - one)))
    sources["llama"] = build(root, "llama", layers)
    return sources


def on_disk(run: Run) -> float:
    return run.wall_s + (run.sync_s or 0)


def rotated(items: list[str], r: int) -> list[str]:
    return items[r % len(items) :] + items[: r % len(items)]


def main(argv: list[str] | None = None) -> int:
    from test_gguf import CONVERTER

    from tokenizer_helpers import llama_cpp_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/families"))
    args = parser.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    sources = build_all(work)
    llama_cpp = llama_cpp_dir()
    env = f"PYTHONPATH={llama_cpp / 'gguf-py'}"
    models = list(sources)
    commands: dict[str, dict[str, list[str]]] = {}
    outs: dict[str, dict[str, Path]] = {}
    for model, src in sources.items():
        pre = MODELS[model][2]
        size = weight_bytes(src)
        blob = work / f"blob-{model}"
        if not blob.exists() or blob.stat().st_size != size:
            with blob.open("wb") as f:
                f.truncate(size)
        o = {t: work / f"out-{model}-{t}" for t in (*TARGETS, "llama.cpp", "cp", "dd")}
        o |= {t: work / f"out-{model}-{t}.gguf" for t in ("gguf", "llama.cpp")}
        ckptkit = [sys.executable, "-m", "ckptkit", "convert", str(src)]
        cmds = {t: [*ckptkit, str(o[t]), "--to", t, "--quiet"] for t in TARGETS}
        cmds["gguf"] += ["--dtype", "bfloat16", "--gguf-pre", pre]
        cmds["llama.cpp"] = ["env", env, sys.executable, "-c", CONVERTER, str(src), pre, str(o["llama.cpp"]), "bf16"]
        cmds["cp"] = ["cp", "-r", str(src), str(o["cp"])]
        cmds["dd"] = durable_copy(blob, o["dd"])
        commands[model], outs[model] = cmds, o
        config = json.loads((src / "config.json").read_text())
        print(f"{model}: {config['num_hidden_layers']} layers, HF safetensors bf16, {size / MB:.0f} MB")
    names = list(commands[models[0]])
    runs: dict[tuple[str, str], list[Run]] = {(m, n): [] for m in models for n in names}
    load: list[float] = []
    same: dict[str, bool] = {}
    for r in range(args.repeat):
        load.append(os.getloadavg()[0])
        for name in rotated(names, r):
            for model in rotated(models, r):
                out = outs[model][name]
                remove(out)
                warm([work / f"blob-{model}"] if name == "dd" else [sources[model]])
                cwd = llama_cpp if name == "llama.cpp" else None
                runs[model, name].append(timed(commands[model][name], work / f"{model}-{name}-{r}.log", cwd))
                if r < args.repeat - 1 or name not in ("gguf", "llama.cpp"):
                    remove(out)
        print(f"round {r + 1} done, load average before it {load[-1]:.1f}", flush=True)
    for model in models:
        same[model] = digest(outs[model]["gguf"]) == digest(outs[model]["llama.cpp"])
        for out in outs[model].values():
            remove(out)
    print(f"{args.repeat} rounds; 1-minute load average before each: {', '.join(f'{x:.1f}' for x in load)}")
    verdicts = ", ".join(f"{m} {'yes' if same[m] else 'NO'}" for m in models)
    print(f"ckptkit's GGUF tensors identical to llama.cpp's: {verdicts}")
    labels = {t: f"ckptkit --to {t}" for t in TARGETS}
    labels |= {"gguf": "ckptkit --to gguf (bf16)", "llama.cpp": "convert_hf_to_gguf.py bf16"}
    labels |= {"cp": "cp -r (+ sync)", "dd": "dd oflag=direct conv=fsync"}
    for model in models:
        size = weight_bytes(sources[model])
        print(f"\n{model} ({size / MB:.0f} MB)")
        print(f"{'command':<28} {'until on disk s':>15} {'MB/s':>7} {'CPU s':>6} {'peak RSS':>10}  each round (s)")
        for name in names:
            rs = runs[model, name]
            disk = statistics.median(on_disk(x) for x in rs)
            cpu = statistics.median(x.user_s + x.sys_s for x in rs)
            rss = statistics.median(x.peak_rss for x in rs) / MB
            each = ", ".join(f"{on_disk(x):.1f}" for x in rs)
            print(f"{labels[name]:<28} {disk:>15.1f} {size / MB / disk:>7.1f} {cpu:>6.1f} {rss:>7.0f} MB  {each}")
    print("\nper byte against the Llama-shaped model: MB/s of the family / MB/s of llama, per round (median)")
    print(f"{'command':<28} " + " ".join(f"{m:>28}" for m in models if m != "llama"))
    for name in names:
        cells = []
        for model in models:
            if model == "llama":
                continue
            scale = weight_bytes(sources[model]) / weight_bytes(sources["llama"])
            pairs = zip(runs[model, name], runs["llama", name], strict=True)
            ratio = [scale * on_disk(b) / on_disk(a) for a, b in pairs]
            cells.append(f"{', '.join(f'{x:.2f}' for x in ratio)} ({statistics.median(ratio):.2f}x)")
        print(f"{labels[name]:<28} " + " ".join(f"{c:>28}" for c in cells))
    return 0


if __name__ == "__main__":
    with reporting("families.py"):
        code = main()
    sys.exit(code)
