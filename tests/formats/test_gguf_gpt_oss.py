"""gpt-oss to GGUF as llama.cpp's ``gpt-oss`` writes it: byte for byte its
``convert_hf_to_gguf.py`` output for every outtype, the stacked experts transposed with the
interleaved gate and up rows split, their biases split the same way, the sinks as
``attn_sinks.weight``; the o200k pre-tokenizer as llama.cpp names it (``gpt-4o``). The
release's MXFP4 experts as llama.cpp keeps them (GGML's MXFP4, repacked), for every outtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_family_helpers import assert_reads_back, llama_cpp_references
from test_gguf import OUTTYPES, assert_same_gguf

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

SRC = FIXTURES / "hf" / "gpt_oss"
MXFP4_SRC = FIXTURES / "mxfp4" / "gpt_oss"  # OpenAI's release layout: MXFP4 experts (_blocks, _scales)
PRE = "gpt-4o"  # llama.cpp's name for the o200k split of gpt-oss's tokenizer (the fixture's tiny one)


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    """llama.cpp's GGUF of an HF folder for an outtype, every outtype from one converter process."""
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_hf_to_gguf_equals_llama_cpp(
    dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    ours = tmp_path / "ours.gguf"
    convert(SRC, ours, ConvertOptions("gguf", gguf_pre=PRE, dtype=dtype, allow_lossy_cast=dtype is not None))
    assert_same_gguf(ours, reference(SRC, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_mxfp4_release_to_gguf_equals_llama_cpp(
    dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """Every outtype the converter takes keeps the MXFP4 experts (repacked, written first)."""
    ours = tmp_path / "ours.gguf"
    convert(MXFP4_SRC, ours, ConvertOptions("gguf", gguf_pre=PRE, dtype=dtype, allow_lossy_cast=dtype is not None))
    assert_same_gguf(ours, reference(MXFP4_SRC, dtype))


def test_experts_are_transposed_and_gate_up_split_by_parity(tmp_path: Path) -> None:
    import torch
    from gguf import GGUFReader
    from safetensors import safe_open

    convert(SRC, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    tensors = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
    stored = {}
    for p in sorted(SRC.glob("*.safetensors")):
        with safe_open(p, "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.1.")}
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H]

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.int16).numpy().tobytes()

    assert tensors["blk.1.ffn_gate_exps.weight"].data.tobytes() == raw(gate_up[:, 0::2])
    assert tensors["blk.1.ffn_up_exps.weight"].data.tobytes() == raw(gate_up[:, 1::2])
    down = stored["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    assert tensors["blk.1.ffn_down_exps.weight"].data.tobytes() == raw(down)
    bias = stored["model.layers.1.mlp.experts.gate_up_proj_bias"].float()
    assert tensors["blk.1.ffn_up_exps.bias"].data.tobytes() == bias[:, 1::2].contiguous().numpy().tobytes()
    sinks = stored["model.layers.1.self_attn.sinks"].float().numpy().tobytes()
    assert tensors["blk.1.attn_sinks.weight"].data.tobytes() == sinks
    assert GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.pre"].contents() == PRE


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llama_cpp_gguf_reads_back_bitwise(
    dtype: str, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """Experts transposed back with gate and up rows interleaved again, the sinks renamed back;
    yarn untruncated, as the release states."""
    assert_reads_back(reference(SRC, dtype), SRC, tmp_path / "hf")
