"""``--to gguf --dtype Q4_K_M`` (llama-quantize's file types) gives what llama.cpp gives: its
converter to the source's 16-bit type, then ``llama-quantize`` with that type.

The reference is llama.cpp's own code: the 16-bit GGUF its converter writes (``llama_cpp``),
and each tensor quantized from that file's values by ``ggml-quants.c`` (``ggml_reference``,
the functions ``llama-quantize`` calls without an imatrix). Which type each tensor gets,
and the file order, are llama-quantize's rules (``src/llama-quant.cpp``) worked out by hand
for these models below. The header is the 16-bit GGUF's, ``general.quantization_version``
and ``general.file_type`` moved last, as llama-quantize writes them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from ggml_reference import reference
from test_gguf import llama_cpp_gguf

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES
from tokenizer_helpers import gguf_reader

FILE_TYPE = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
}


def _layer_order(name: str) -> tuple[int, str]:
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's ``use_more_bits``: 8 layers -> 0, 3, 6, 7; 2 layers -> none."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _expected_type(ftype: str, name: str, row: int, bf16: str, n: int) -> str:
    """llama-quantize's type for a tensor of the widened dense Llama of ``n`` layers (the
    bundled fixtures' rows of 64 and 192: ``test_llama_quantize_golden``)."""
    if name.endswith("norm.weight") or name == "rope_freqs.weight":
        return bf16
    base = {"Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K"}.get(ftype, ftype)
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    if name == "output.weight":
        kind = "Q6_K" if row % (256 if "K" in ftype else 32) == 0 else "Q8_0"
    elif "attn_v" in name and ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n):
        kind = "Q6_K"
    elif "attn_v" in name and ftype == "Q4_K_S" and layer < 4:
        kind = "Q5_K"
    elif "ffn_down" in name and ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n):
        kind = "Q6_K"
    elif "ffn_down" in name and ftype == "Q4_K_S" and layer < n // 8:
        kind = "Q5_K"
    else:
        kind = base
    if row % 256 and kind in ("Q4_K", "Q5_K", "Q6_K"):
        kind = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}[kind]
    return kind


def _check(ours: Path, ref16: Path, ftype: str) -> dict[str, str]:
    """Our file against the reference; returns the tensor types."""
    got, base = gguf_reader(ours), gguf_reader(ref16)
    keys = [k for k in base.fields if k not in ("general.quantization_version", "general.file_type")]
    keys += ["general.quantization_version", "general.file_type"]
    assert list(got.fields) == keys
    for k in keys[:-2]:
        assert got.fields[k].contents() == base.fields[k].contents(), k
    assert got.fields["general.quantization_version"].contents() == 2
    assert got.fields["general.file_type"].contents() == FILE_TYPE[ftype]
    src = {t.name: t for t in base.tensors}
    n = int(base.fields["llama.block_count"].contents())
    assert [t.name for t in got.tensors] == sorted(src, key=_layer_order)
    types = {}
    for t in got.tensors:
        s = src[t.name]
        row = int(s.shape[0])
        kind = t.tensor_type.name
        types[t.name] = kind
        assert kind == _expected_type(ftype, t.name, row, s.tensor_type.name, n), t.name
        assert list(t.shape) == list(s.shape)
        if kind == s.tensor_type.name:
            assert bytes(t.data) == bytes(s.data), t.name
            continue
        values = np.asarray(s.data)
        if s.tensor_type.name == "BF16":
            values = (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        values = values.astype(np.float32).reshape(-1)
        want = values.astype(np.float16).view(np.uint8) if kind == "F16" else reference(kind, values)
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), want.reshape(-1)), t.name
    return types


def _wide_llama(out: Path) -> Path:
    """The llama2 fixture widened to rows of 256 and 512, 8 layers, 2 KV heads (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = FIXTURES / "hf" / "llama2"
    cfg = AutoConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_key_value_heads = 256, 512, 8, 2
    cfg.head_dim = 64
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def wide(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wide")
    hf = _wide_llama(root / "hf")
    return hf, llama_cpp_gguf(llama_cpp, hf, root / "bf16.gguf", "auto")


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q4_0"])
def test_wide_model_quantizes_as_llama_quantize(ftype: str, wide: tuple[Path, Path], tmp_path: Path) -> None:
    """Rows of 256 and 512: the K mixes, more bits for attn_v / ffn_down of layers 0, 3, 6, 7."""
    hf, bf16 = wide
    out = tmp_path / "model.gguf"
    convert(hf, out, ConvertOptions("gguf", dtype=ftype))
    types = _check(out, bf16, ftype)
    assert types["output.weight"] == "Q6_K"


def test_a_type_ckptkit_does_not_write_is_one_line(tmp_path: Path) -> None:
    """llama-quantize's IQ2/IQ3 types (they need an importance matrix search ckptkit lacks)."""
    with pytest.raises(CkptkitError, match=r"^--dtype must be one of bfloat16, float16, float32, not 'IQ2_XXS'$"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "m.gguf", ConvertOptions("gguf", dtype="IQ2_XXS"))
    assert not (tmp_path / "m.gguf").exists()
