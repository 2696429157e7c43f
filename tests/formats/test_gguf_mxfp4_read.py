"""A gpt-oss GGUF whose experts are GGML MXFP4 (ckptkit's, byte-equal to llama.cpp's converter,
and the converter's own) read back as the release it was written from: without ``--dtype``
the release's ``*_blocks`` / ``*_scales`` and ``quantization_config``, every tensor
byte-identical to the release's (MXFP4 -> GGUF -> HF is bitwise), kept through internal and
DCP; with ``--dtype bfloat16`` byte-equal to transformers' ``Mxfp4Config(dequantize=True)``
load of the release (not to ggml's own MXFP4 arithmetic, which reads code 8, -0, as +0)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf_family_helpers import llama_cpp_references
from quant_helpers import mxfp4_dequantized
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

SRC = FIXTURES / "mxfp4" / "gpt_oss"  # OpenAI's release layout: MXFP4 experts (_blocks, _scales)
PRE = "gpt-4o"


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ckptkit's GGUF of the release (``--dtype`` none: the other tensors bf16, as the release)."""
    out = tmp_path_factory.mktemp("mxfp4") / "m.gguf"
    convert(SRC, out, ConvertOptions("gguf", gguf_pre=PRE))
    return out


def equal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are byte-identical (dtype, shape and bytes)."""

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    return [k for k in a if k in b and a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and raw(a[k]) == raw(b[k])]


def quant_config(folder: Path) -> object:
    return json.loads((folder / "config.json").read_text()).get("quantization_config")


def test_kept_as_the_release_every_tensor_bitwise(ours: Path, tmp_path: Path) -> None:
    convert(ours, tmp_path / "hf", ConvertOptions("hf"))
    release, back = load_file(SRC / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(back) == sorted(release)
    assert len(equal_tensors(release, back)) == len(release) == 41  # 8 blocks/scales, 33 bf16
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (SRC / "model.safetensors").read_bytes()
    assert quant_config(tmp_path / "hf") == quant_config(SRC)


@pytest.mark.parametrize("via", ["internal", "dcp"])
def test_kept_through_internal_and_dcp(via: str, ours: Path, tmp_path: Path) -> None:
    convert(ours, tmp_path / via, ConvertOptions(via))
    convert(tmp_path / via, tmp_path / "hf", ConvertOptions("hf"))
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (SRC / "model.safetensors").read_bytes()
    assert quant_config(tmp_path / "hf") == quant_config(SRC)


def test_gguf_to_gguf_keeps_every_tensor(ours: Path, tmp_path: Path) -> None:
    from gguf import GGUFReader

    convert(ours, tmp_path / "again.gguf", ConvertOptions("gguf", gguf_pre=PRE, tokenizer=str(SRC)))
    a, b = GGUFReader(ours).tensors, GGUFReader(tmp_path / "again.gguf").tensors
    assert [(t.name, t.tensor_type) for t in a] == [(t.name, t.tensor_type) for t in b]
    assert sum(x.data.tobytes() == y.data.tobytes() for x, y in zip(a, b, strict=True)) == len(a) == 41


def assert_dequantized_as_transformers(gguf: Path, out: Path) -> None:
    convert(gguf, out, ConvertOptions("hf", dtype="bfloat16"))
    theirs, ours = mxfp4_dequantized(SRC), load_file(out / "model.safetensors")
    assert quant_config(out) is None
    assert sorted(ours) == sorted(theirs)
    assert len(equal_tensors(theirs, ours)) == len(theirs) == 37


def test_dequantized_equals_transformers_loader(ours: Path, tmp_path: Path) -> None:
    assert_dequantized_as_transformers(ours, tmp_path / "hf")


def test_experts_mxfp4_in_some_layers_only_is_one_line(ours: Path, tmp_path: Path) -> None:
    """A GGUF whose layer-1 up experts are F32 (the rest MXFP4) is no release: refused, nothing written."""
    import gguf
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(ours)
    writer = GGUFWriter(tmp_path / "mixed.gguf", arch="gpt-oss")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_up_exps.weight":
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CkptkitError, match=r"blk\.1\.ffn_up_exps\.weight is F32 \[3, 32, 96\]; the release") as err:
        convert(tmp_path / "mixed.gguf", tmp_path / "hf", ConvertOptions("hf"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_llama_cpp_mxfp4_gguf_reads_back_as_the_release(
    dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """llama.cpp's GGUF of the release: the experts byte-identical to the release's, the other
    tensors at the types they went in (bf16; float32 of the same values from an f32 GGUF)."""
    convert(reference(SRC, dtype), tmp_path / "hf", ConvertOptions("hf"))
    release, back = load_file(SRC / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(back) == sorted(release)
    assert quant_config(tmp_path / "hf") == quant_config(SRC)
    if dtype == "float32":
        wide = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in release.items()}
        assert len(equal_tensors(wide, back)) == len(release) == 41
    else:
        assert len(equal_tensors(release, back)) == len(release) == 41


@pytest.mark.slow
def test_llama_cpp_mxfp4_gguf_dequantized_equals_transformers(
    reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    assert_dequantized_as_transformers(reference(SRC, "bfloat16"), tmp_path / "hf")
