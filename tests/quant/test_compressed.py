"""compressed-tensors sources (``quant_method: "compressed-tensors"``): inspected,
dequantized byte-equal to compressed-tensors' own decompressors (and transformers'
dequantizing loader where it loads the fixture), proven lossless by ``verify``, kept as
stored where the target holds them.

Fixtures: ``fixtures/ct/`` (``fixtures/make_ct_fixtures.py``: compressed-tensors' observer
and compressors, as llm-compressor makes releases)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path
from ckptkit.verify import verify_paths

from conftest import FIXTURES

FP8 = FIXTURES / "ct" / "fp8"
INT8 = FIXTURES / "ct" / "int8"


@pytest.fixture(scope="session")
def reference() -> Any:
    """compressed-tensors' decompression of one fixture: {weight name: dequantized tensor}."""
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.utils.match import match_name

    def decompressed(folder: Path) -> dict[str, torch.Tensor]:
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        stored = load_file(folder / "model.safetensors")
        out = {}
        for name in stored:
            if not name.endswith(".weight_scale"):
                continue
            module = name.removesuffix(".weight_scale")
            group = next(
                g for g in config["config_groups"].values()
                if any(t == "Linear" or match_name(module, t) for t in g["targets"])
            )  # fmt: skip
            scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
            compressor = BaseCompressor.get_value_from_registry(config["format"])
            parts = {"weight": stored[module + ".weight"], "weight_scale": stored[name]}
            out[module + ".weight"] = compressor.decompress(parts, scheme)["weight"]
        return out

    return decompressed


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_inspect_shows_method_schemes_and_dtypes() -> None:
    q = inspect_path(FP8)["quantization"]
    assert q["method"] == "compressed-tensors"
    assert q["block"] == "16x16, channel, tensor"
    assert q["stored"] == "float8_e4m3fn"
    assert q["dequantized"] == "bfloat16"
    assert q["quantized_tensors"] == 13  # 7 linear weights in each of 2 layers, but one ignored
    assert q["dropped_activation_scales"] == 7  # input_scale of O and down, k_scale, v_scale; down ignored in layer 1
    q = inspect_path(INT8)["quantization"]
    assert (q["block"], q["stored"], q["quantized_tensors"]) == ("channel", "int8", 14)


def test_fp8_dequantized_equals_compressed_tensors(reference: Any, tmp_path: Path) -> None:
    """bf16 scales: compressed-tensors multiplies in bf16, one rounding of an exact product."""
    convert(FP8, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    ours, ref, stored = tensors(tmp_path / "out"), reference(FP8), tensors(FP8)
    assert len(ref) == 13
    for name, t in ref.items():
        assert t.dtype == torch.bfloat16
        assert _bytes_equal(ours[name], t), name
    for name, t in ours.items():  # the rest as stored; scales and activation scales gone
        if name not in ref:
            assert _bytes_equal(t, stored[name]), name
    assert sorted(set(stored) - set(ours))[:2] == ["model.layers.0.mlp.down_proj.input_scale"] + [
        "model.layers.0.mlp.down_proj.weight_scale"
    ]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config


def test_int8_dequantized_equals_compressed_tensors(reference: Any, tmp_path: Path) -> None:
    """float32 scales: compressed-tensors' float32 output, and bf16 its one rounding."""
    convert(INT8, tmp_path / "f32", ConvertOptions("hf", dtype="float32"))
    convert(INT8, tmp_path / "bf16", ConvertOptions("hf", dtype="bfloat16"))
    f32, bf16, ref = tensors(tmp_path / "f32"), tensors(tmp_path / "bf16"), reference(INT8)
    assert len(ref) == 14
    for name, t in ref.items():
        assert _bytes_equal(f32[name], t), name
        assert _bytes_equal(bf16[name], t.to(torch.bfloat16)), name


def test_int8_dequantized_equals_transformers_loader(tmp_path: Path) -> None:
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        INT8, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    )
    convert(INT8, tmp_path / "out", ConvertOptions("hf", dtype="float32"))
    ours = tensors(tmp_path / "out")
    weights = [k for k in model.state_dict() if k.endswith("_proj.weight")]
    assert len(weights) == 14
    for name in weights:
        assert _bytes_equal(ours[name], model.state_dict()[name]), name


def test_verify_proves_dequantization(tmp_path: Path) -> None:
    for src, n, total in ((FP8, 13, 21), (INT8, 14, 21)):
        out = tmp_path / src.name
        convert(src, out, ConvertOptions("hf", dtype="bfloat16"))
        report = verify_paths(src, out)
        assert report.verdict().startswith(f"DEQUANTIZED: {total - n} of {total} tensors bitwise equal, {n} dequant")
        assert report.exit_code() == 0


def test_kept_through_hf_bin_and_internal(tmp_path: Path) -> None:
    """Without --dtype: the stored bytes, scales and quantization_config travel unchanged."""
    path = INT8
    for i, to in enumerate(["hf-bin", "internal", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(INT8, out).verdict().startswith("IDENTICAL: all 35 tensors")
        path = out
    assert (path / "model.safetensors").read_bytes() == (INT8 / "model.safetensors").read_bytes()
    assert (path / "config.json").read_text() == (INT8 / "config.json").read_text()


@pytest.mark.parametrize("dcp", ["dcp", "dcp-titan"])
def test_per_channel_scales_move_with_the_rows_through_dcp(dcp: str, tmp_path: Path) -> None:
    """DCP stores Q/K rows in Meta's order: a per-channel scale's rows move with its weight's
    there (torch's own DCP reader gets them so) and back, so HF -> DCP -> HF is byte-identical."""
    import torch.distributed.checkpoint as torch_dcp

    result = convert(INT8, tmp_path / "dcp", ConvertOptions(dcp))
    assert not any("dequantized" in n for n in result.notes)
    reader = torch_dcp.FileSystemReader(str(tmp_path / "dcp"))
    meta = reader.read_metadata().state_dict_metadata
    held = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.endswith("wq.weight_scale")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process"
        torch_dcp.load(held, storage_reader=reader)
    stored = tensors(INT8)
    heads = json.loads((INT8 / "config.json").read_text())["num_attention_heads"]
    for layer in (0, 1):
        scale = stored[f"model.layers.{layer}.self_attn.q_proj.weight_scale"]
        meta_order = scale.reshape(heads, 2, -1, 1).transpose(1, 2).reshape(scale.shape)  # rotate-half -> pairs
        (name,) = [k for k in held if k.startswith(f"layers.{layer}.")]
        assert torch.equal(held[name], meta_order) and not torch.equal(meta_order, scale)
    convert(tmp_path / "dcp", tmp_path / "hf", ConvertOptions("hf"))
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (INT8 / "model.safetensors").read_bytes()
    assert verify_paths(INT8, tmp_path / "dcp").verdict().startswith("IDENTICAL")


@pytest.mark.parametrize("to", ["dcp", "internal"])
def test_groups_naming_hf_modules_are_dequantized_where_the_names_change(to: str, tmp_path: Path) -> None:
    """The FP8 fixture's groups target HF module names (``re:.*self_attn...``), which DCP and
    internal do not use: kept there, it would not read back; dequantized, with the note."""
    result = convert(FP8, tmp_path / "out", ConvertOptions(to))
    assert any(f"13 compressed-tensors weights dequantized to bfloat16 (--to {to}" in n for n in result.notes)
    assert verify_paths(FP8, tmp_path / "out").verdict().startswith("DEQUANTIZED: 8 of 21 tensors")


def test_fp8_kept_but_for_its_activation_scales(tmp_path: Path) -> None:
    convert(FP8, tmp_path / "bin", ConvertOptions("hf-bin"))
    convert(tmp_path / "bin", tmp_path / "back", ConvertOptions("hf"))
    back, stored = tensors(tmp_path / "back"), tensors(FP8)
    assert sorted(set(stored) - set(back)) == sorted(
        k for k in stored if k.endswith(("input_scale", "k_scale", "v_scale"))
    )
    assert all(_bytes_equal(t, stored[k]) for k, t in back.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((FP8 / "config.json").read_text())


def test_ignored_modules_are_read_as_they_are(tmp_path: Path) -> None:
    src = shutil.copytree(FP8, tmp_path / "src")
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.0\\.mlp\\.down_proj"]
    (src / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CkptkitError, match=r"ignore lists model.layers.0.mlp.down_proj.weight, which is stored"):
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
