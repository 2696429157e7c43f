"""Every GGUF type the gguf package dequantizes is read back, streamed, a chunk of blocks at a
time: a GGUF ckptkit wrote in llama-quantize's Q4_0 / Q5_1 / Q4_K_M converts back to HF with
each tensor the gguf package's dequantization of the stored blocks (Q/K rows unpermuted)."""

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


def test_a_q4_0_gguf_is_a_training_and_merge_base(tmp_path: Path) -> None:
    """A GGUF written in Q4_0 (a type only the gguf package dequantizes) opens, and every tensor
    comes out as floats, as training and merging read a base."""
    from ckptkit.checkpoint import open_checkpoint

    out = tmp_path / "m.gguf"
    convert(FIXTURES / "hf" / "llama2", out, ConvertOptions("gguf", dtype="Q4_0"))
    with open_checkpoint(out) as ckpt:
        for lazy in ckpt.tensors.values():
            assert lazy.get().dtype in (torch.float32, torch.bfloat16, torch.float16)
