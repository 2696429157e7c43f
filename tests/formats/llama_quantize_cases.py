"""The sources, runs and imatrix files that ``llama_quantize_golden.json`` records llama-quantize's
output for (made by ``make_llama_quantize_golden.py``, checked by ``test_llama_quantize_golden.py``),
and the facts of a GGUF both sides compare: tensor types, sha256 of tensor bytes, metadata.

Sources: bundled fixtures (rows of 64 or 40: every 256-block type falls back; qwen2 ties its
embeddings; mixtral has 4 experts) and two seeded models made here with transformers
(``wide``: a Llama of 8 layers, rows of 256, 8 heads over 2 KV heads; ``moe8``: a
Mixtral of 8 experts, rows of 256). The imatrix files are written by their documented layouts
(llama.cpp's ``llama-imatrix`` needs a model run), from seeded values.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from conftest import FIXTURES

TYPES = (
    "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K TQ1_0 TQ2_0 IQ4_NL IQ4_XS"
).split()
MODELS = ("llama3", "qwen2", "mixtral", "wide", "moe8")
# the pre-tokenizer both converters are told (llama.cpp does not recognise the tiny BPE fixtures)
PRE = {"llama3": "llama-bpe", "qwen2": "qwen2", "wide": "llama-bpe"}
# (model, file type, llama-quantize options); "IMATRIX.dat" / "IMATRIX.gguf": the model's imatrix file
OPTION_RUNS: list[tuple[str, str, tuple[str, ...]]] = [
    ("wide", "Q4_K_M", ("--pure",)),
    ("wide", "Q6_K", ("--pure",)),
    ("wide", "Q4_0", ("--pure",)),
    ("wide", "Q4_K_M", ("--output-tensor-type", "q8_0")),
    ("wide", "Q4_K_M", ("--output-tensor-type", "f16", "--token-embedding-type", "q5_k")),
    ("wide", "Q5_K_M", ("--token-embedding-type", "Q8_0")),
    ("wide", "Q4_K_M", ("--leave-output-tensor",)),
    ("wide", "Q4_K_M", ("--pure", "--output-tensor-type", "q4_k")),
    ("qwen2", "Q4_K_M", ("--output-tensor-type", "q8_0")),
    ("qwen2", "Q4_K_M", ("--token-embedding-type", "q4_0")),
    ("qwen2", "Q4_0", ("--leave-output-tensor",)),
    ("llama3", "Q4_K_M", ("--leave-output-tensor",)),
    ("mixtral", "Q4_0", ("--pure",)),
    ("moe8", "Q4_K_M", ("--pure",)),
    *[("wide", t, ("--imatrix", "IMATRIX.dat")) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S", "Q6_K")],
    *[("wide", t, ("--imatrix", "IMATRIX.gguf")) for t in ("Q4_K_M", "Q5_K_S", "Q5_K_M", "IQ4_XS", "Q3_K_M")],
    *[("wide", t, ("--imatrix", "IMATRIX.dat")) for t in ("Q2_K", "Q3_K_S", "IQ4_NL", "IQ4_XS")],
    *[("wide", t, ("--imatrix", "IMATRIX.gguf")) for t in ("Q2_K", "Q3_K_L", "IQ4_NL", "TQ2_0")],
    ("moe8", "Q4_K_M", ("--imatrix", "IMATRIX.gguf")),
    ("moe8", "Q3_K_M", ("--imatrix", "IMATRIX.gguf")),
    ("moe8", "IQ4_XS", ("--imatrix", "IMATRIX.dat")),
    ("moe8", "Q4_0", ("--imatrix", "IMATRIX.dat")),
    ("llama3", "Q4_0", ("--imatrix", "IMATRIX.dat")),
]
DATASET = "wiki.train.raw"


def runs() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every run: each model at each type, then the option runs."""
    return [(m, t, ()) for m in MODELS for t in TYPES] + OPTION_RUNS


def run_id(model: str, ftype: str, opts: tuple[str, ...]) -> str:
    return " ".join((model, ftype, *opts))


def source(model: str, root: Path) -> Path:
    """The HF folder of ``model`` (a fixture, or made under ``root`` once)."""
    if model not in ("wide", "moe8"):
        return FIXTURES / "hf" / model
    out = root / model
    if not (out / "config.json").exists():
        _make(model, out)
    return out


def _make(model: str, out: Path) -> None:
    """A seeded model of the fixture's config, widened (every parameter random)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = FIXTURES / "hf" / ("llama3" if model == "wide" else "mixtral")
    cfg = AutoConfig.from_pretrained(src)
    if model == "wide":
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 256, 8
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 2, 32
    else:
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 256, 2
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 64
        cfg.num_local_experts, cfg.num_experts_per_tok = 8, 2
    torch.manual_seed(0)
    made = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in made.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    made.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)


def imatrix_entries(tensors: list[Any]) -> dict[str, tuple[int, int]]:
    """What llama-imatrix collects for the 16-bit GGUF of ``tensors`` (``[name, type, GGUF
    dims]``, :func:`facts`): each ``blk.*`` matrix (name -> columns, experts), plus an entry
    of no tensor of the model (ignored by llama-quantize)."""
    out = {}
    for name, _, dims in tensors:
        if name.startswith("blk.") and len(dims) >= 2 and "norm" not in name and "gate_inp" not in name:
            out[name] = (dims[0], dims[2] if len(dims) == 3 else 1)
    out["blk.99.attn_q.weight"] = (64, 1)
    return out


def write_imatrix(path: Path, entries: dict[str, tuple[int, int]]) -> None:
    """An imatrix of ``entries`` at ``path`` (``.dat``: legacy layout; ``.gguf``: GGUF), from
    seeded sums and counts (one expert of each 3-D entry never called, in the GGUF)."""
    rng = np.random.default_rng(7)
    values = {n: rng.uniform(0.5, 40.0, cols * experts).astype(np.float32) for n, (cols, experts) in entries.items()}
    if path.suffix == ".dat":
        blob = bytearray(struct.pack("<i", len(entries)))
        for name, v in values.items():
            blob += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 13, v.size) + v.tobytes()
        blob += struct.pack("<i", 5) + struct.pack("<i", len(DATASET)) + DATASET.encode()
        path.write_bytes(bytes(blob))
        return
    import gguf

    from ckptkit.formats.gguf.writer import quiet_gguf

    w = gguf.GGUFWriter(path, arch="", endianess=gguf.GGUFEndian.LITTLE)
    w.kv_data[0].pop("general.architecture", None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [DATASET])
    w.add_uint32("imatrix.chunk_count", 5)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, v in values.items():
        cols, experts = entries[name]
        counts = np.full((1, experts), 512 * 5, np.float32)
        if experts > 1:
            counts[0, 1] = 0
        w.add_tensor(name + ".in_sum2", v.reshape(experts, cols))
        w.add_tensor(name + ".counts", counts)
    with quiet_gguf():
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    w.close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, list) and len(value) > 16:
        return {"sha256": _sha(json.dumps(value).encode())}
    return value


def facts(path: Path) -> dict[str, Any]:
    """A GGUF's facts: metadata ``[key, value types, value]`` in order (arrays over 16 items by
    their sha256), tensors ``[name, type, GGUF dims]`` in order, and the sha256 of each tensor's bytes."""
    from tokenizer_helpers import gguf_reader

    r: Any = gguf_reader(path)
    meta = [
        [k, [t.name for t in f.types], _value(f)] for k, f in r.fields.items() if not k.startswith("GGUF.")
    ]  # fmt: skip
    tensors = [[t.name, t.tensor_type.name, [int(d) for d in t.shape]] for t in r.tensors]
    data = {t.name: _sha(np.asarray(t.data).tobytes()) for t in r.tensors}
    return {"meta": meta, "tensors": tensors, "data": data}


def meta_sha(meta: list[Any]) -> str:
    return _sha(json.dumps(meta).encode())
