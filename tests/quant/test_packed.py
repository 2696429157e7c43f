"""compressed-tensors ``pack-quantized`` int4 sources (W4A16): inspected, dequantized
byte-equal to compressed-tensors' own ``PackedQuantizationCompressor.decompress`` and to
transformers' dequantizing loader, proven lossless by ``verify``, kept as stored
(``X.weight_packed`` and its scales) where the target holds them.

Fixtures: ``fixtures/ct/w4a16`` (symmetric) and ``fixtures/ct/w4a16-asym`` (zero points
packed along rows; K/V have 20 rows), made by ``fixtures/make_ct_fixtures.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.inspection import inspect_path
from ckptkit.verify import verify_paths

from conftest import FIXTURES

SYM = FIXTURES / "ct" / "w4a16"
ASYM = FIXTURES / "ct" / "w4a16-asym"
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


@pytest.fixture(scope="session")
def reference() -> Any:
    """compressed-tensors' decompression of a packed fixture: {weight name: bf16 tensor}."""
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def decompressed(folder: Path) -> dict[str, torch.Tensor]:
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        group = config["config_groups"]["group_0"]
        scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
        compressor = BaseCompressor.get_value_from_registry(config["format"])
        stored = load_file(folder / "model.safetensors")
        out = {}
        for name in stored:
            if name.endswith(".weight_packed"):
                module = name.removesuffix(".weight_packed")
                parts = {p: stored[f"{module}.{p}"] for p in PARTS if f"{module}.{p}" in stored}
                out[module + ".weight"] = compressor.decompress(parts, scheme)["weight"]
        return out

    return decompressed


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_inspect_shows_packed_groups() -> None:
    for folder, zero in ((SYM, "none"), (ASYM, "int4 (asymmetric)")):
        q = inspect_path(folder)["quantization"]
        assert (q["method"], q["block"], q["stored"]) == ("compressed-tensors", [1, 8], "int32")
        assert (q["quantized_tensors"], q["zero_points"], q["dequantized"]) == (14, zero, "bfloat16")
        assert q["packing"].startswith("8 int4 a word")


@pytest.mark.parametrize("folder", [SYM, ASYM], ids=["symmetric", "asymmetric"])
def test_dequantized_equals_compressed_tensors_and_verified(reference: Any, folder: Path, tmp_path: Path) -> None:
    convert(folder, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    ours, ref = load_file(tmp_path / "out" / "model.safetensors"), reference(folder)
    assert len(ref) == 14
    assert [n for n, t in ref.items() if not _bytes_equal(ours[n], t)] == []
    assert not any(k.endswith(PARTS) for k in ours)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    report = verify_paths(folder, tmp_path / "out")
    assert report.verdict().startswith("DEQUANTIZED: 7 of 21 tensors bitwise equal, 14 dequantized weights give back")
    assert report.exit_code() == 0


def test_dequantized_equals_transformers_loader(tmp_path: Path) -> None:
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        ASYM, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    convert(ASYM, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), model.state_dict()
    weights = [k for k in theirs if k.endswith("_proj.weight")]
    assert len(weights) == 14
    assert [k for k in weights if not _bytes_equal(ours[k], theirs[k])] == []


def test_kept_through_hf_bin_and_internal(tmp_path: Path) -> None:
    """Without --dtype: weight_packed, its scales, shape and zero points travel unchanged."""
    path = ASYM
    for i, to in enumerate(["hf-bin", "internal", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(ASYM, out).verdict().startswith("IDENTICAL: all 63 tensors")
        path = out
    assert (path / "model.safetensors").read_bytes() == (ASYM / "model.safetensors").read_bytes()
    assert (path / "config.json").read_text() == (ASYM / "config.json").read_text()


def test_dcp_gets_the_reference_dequantization(tmp_path: Path) -> None:
    result = convert(SYM, tmp_path / "dcp", ConvertOptions("dcp"))
    assert any("14 compressed-tensors weights dequantized to bfloat16 (--to dcp" in n for n in result.notes)
    assert verify_paths(SYM, tmp_path / "dcp").verdict().startswith("DEQUANTIZED: 7 of 21 tensors")
