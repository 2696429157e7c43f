"""Every GGUF type the gguf package dequantizes is read back, streamed, a chunk of blocks at a
time: a GGUF ckptkit wrote in llama-quantize's Q4_0 / Q5_1 / Q4_K_M converts back to HF with
each tensor the gguf package's dequantization of the stored blocks (Q/K rows unpermuted), and
so does a GGUF of every type (K, IQ, TQ, MXFP4, NVFP4 blocks) through Meta, DCP and internal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES


@pytest.mark.parametrize("ftype", ["Q4_0", "Q5_1", "Q4_K_M"])
def test_a_quantized_gguf_reads_back_as_the_gguf_package_dequantizes_it(
    ftype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf
    from safetensors.numpy import load_file

    from ckptkit.formats.gguf import quants as q

    src = FIXTURES / "hf" / "llama2"
    out = tmp_path / "m.gguf"
    convert(src, out, ConvertOptions("gguf", dtype=ftype))
    monkeypatch.setattr(q, "CHUNK_BYTES", 3 * 22)  # a few blocks per chunk: chunk edges inside rows
    convert(out, tmp_path / "hf", ConvertOptions("hf", dtype="float32"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    stored = {t.name: t for t in gguf.GGUFReader(out).tensors}
    config = json.loads((src / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    kinds = set()
    for layer in range(config["num_hidden_layers"]):
        for part, hf_name in [
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("ffn_down", "mlp.down_proj"),
        ]:
            t = stored[f"blk.{layer}.{part}.weight"]
            kinds.add(t.tensor_type.name)
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            if part in heads:  # llama.cpp's rows per head back to HF's halves
                n, rows = heads[part], ref.shape[0]
                ref = ref.reshape(n, rows // n // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
            mine = got[f"model.layers.{layer}.{hf_name}.weight"]
            assert np.array_equal(mine.view(np.uint32), ref.astype(np.float32).view(np.uint32)), (layer, part)
    assert kinds - {"Q8_0", "Q4_K", "Q5_K", "Q6_K"}  # at least one type only the gguf package dequantizes


@pytest.mark.parametrize(
    ("family", "ftype", "pre"),
    [("wide", "Q4_K_M", "llama-bpe"), ("wide", "Q6_K", "llama-bpe"), ("mistral", "Q5_1", None)],
)
def test_a_quantized_gguf_read_back_runs_as_transformers_gguf_loader_runs_it(
    family: str, ftype: str, pre: str | None, tmp_path: Path
) -> None:
    """For families transformers' GGUF loader maps, the HF folder ckptkit reads a quantized GGUF
    back into gives the logits ``from_pretrained(..., gguf_file=...)`` gives on the same file
    (``wide``: rows of 256, so the K types are written, not their fallbacks). Not qwen3 here:
    transformers' loader ignores ``key_length`` and builds head_dim 128."""
    import gguf
    from llama_quantize_cases import source
    from transformers import AutoModelForCausalLM

    src = source(family, tmp_path)
    convert(src, tmp_path / "q.gguf", ConvertOptions("gguf", dtype=ftype, gguf_pre=pre))
    convert(tmp_path / "q.gguf", tmp_path / "hf", ConvertOptions("hf", dtype="float32"))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    assert kinds >= {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q6_K": {"Q6_K"}}.get(ftype, {ftype}), kinds
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32)(ids).logits
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(ids).logits
    assert (ours - theirs).abs().max().item() == 0.0


def test_a_q4_0_gguf_is_a_training_and_merge_base(tmp_path: Path) -> None:
    """A GGUF written in Q4_0 (a type only the gguf package dequantizes) opens, and every tensor
    comes out as floats, as training and merging read a base."""
    from ckptkit.checkpoint import open_checkpoint

    out = tmp_path / "m.gguf"
    convert(FIXTURES / "hf" / "llama2", out, ConvertOptions("gguf", dtype="Q4_0"))
    with open_checkpoint(out) as ckpt:
        for lazy in ckpt.tensors.values():
            assert lazy.get().dtype in (torch.float32, torch.bfloat16, torch.float16)


def _valid_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of ``kind`` for ``rows`` random rows: llama-quantize's own (ckptkit's encoders,
    byte-equal to it, or the gguf package's for MXFP4) where one writes the type, else random
    bytes with every block's values finite (the IQ2/IQ3/IQ1 grids and NVFP4 need an imatrix
    or a writer neither has)."""
    import gguf

    from ckptkit.formats.gguf.encoders import ENCODERS
    from ckptkit.formats.gguf.quants import encode_blocks, quantize_q8_0

    qtype = gguf.GGMLQuantizationType[kind]
    x = rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    if kind in ENCODERS:
        return encode_blocks(kind, x).reshape(rows, -1)
    if kind == "Q8_0":
        return quantize_q8_0(x.reshape(-1, 32)).reshape(rows, -1)
    if kind == "MXFP4":
        return gguf.quants.quantize(x, qtype)
    raw = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    bad = ~np.isfinite(gguf.quants.dequantize(raw, qtype)).all(axis=1)
    while bad.any():
        raw[bad] = rng.integers(0, 256, size=(int(bad.sum()), size), dtype=np.uint8)
        bad = ~np.isfinite(gguf.quants.dequantize(raw, qtype)).all(axis=1)
    return raw.reshape(rows, -1)


def _dequantized_types() -> list[str]:
    """Every GGML type the gguf package dequantizes, the 16-bit and 32-bit ones aside."""
    import gguf.quants

    return [t.name for t in gguf.quants._type_traits if t.name not in ("F32", "F16", "BF16")]


# GGUF name -> (HF name, heads whose rows llama.cpp permuted)
HF_NAMES = {
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 4),
    "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", 2),
    "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", 0),
    "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj.weight", 0),
    "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj.weight", 0),
    "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj.weight", 0),
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", 0),
    "token_embd.weight": ("model.embed_tokens.weight", 0),
    "output.weight": ("lm_head.weight", 0),
}
KINDS = _dequantized_types()
GROUPS = {"meta": KINDS[0::3], "dcp": KINDS[1::3], "internal": KINDS[2::3]}  # at most 9 kinds each


@pytest.mark.parametrize("target", sorted(GROUPS))
def test_every_dequantized_type_reads_back_to_every_format(target: str, tmp_path: Path) -> None:
    """A GGUF holding blocks of every type the gguf package dequantizes (a third of them per
    file, one type per matrix) converts to ``target`` and to HF at ``--dtype float32``; from
    either, each matrix is the gguf package's dequantization of its stored blocks, Q/K rows
    unpermuted (bit for bit; NVFP4's zeros may keep their code's sign)."""
    from safetensors.numpy import load_file
    from test_gguf_read import write_llama_gguf

    kinds = dict(zip(HF_NAMES, GROUPS[target], strict=False))
    values = write_llama_gguf(tmp_path / "m.gguf", kinds, np.random.default_rng(5), _valid_blocks)
    convert(tmp_path / "m.gguf", tmp_path / target, ConvertOptions(target, dtype="float32"))
    convert(tmp_path / target, tmp_path / "back", ConvertOptions("hf"))
    convert(tmp_path / "m.gguf", tmp_path / "hf", ConvertOptions("hf", dtype="float32"))
    for folder in ("back", "hf"):
        got = load_file(tmp_path / folder / "model.safetensors")
        for name, kind in kinds.items():
            hf_name, heads = HF_NAMES[name]
            ref = values[name]
            if heads:
                ref = ref.reshape(heads, ref.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(ref.shape)
            same = got[hf_name].view(np.uint32) == ref.view(np.uint32)
            if kind == "NVFP4":  # ckptkit keeps the sign of the code -0, where the package gives +0.0
                same |= (got[hf_name] == 0) & (ref == 0)
            assert same.all(), (folder, name, kind)
