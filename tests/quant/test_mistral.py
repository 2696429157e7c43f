"""Mistral's FP8 consolidated checkpoints (``params.json`` ``quantization.qformat_weight:
"fp8_e4m3"``, per-tensor ``qscale_weight``): inspected, dequantized by the per-tensor
formula (``e4m3 x qscale_weight`` in float32, one rounding) to every format, proven
lossless by ``verify``.

Fixture: ``fixtures/mistral-fp8`` (``fixtures/make_mistral_fp8_fixtures.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.inspection import inspect_path
from ckptkit.verify import verify_paths

from conftest import FIXTURES

SRC = FIXTURES / "mistral-fp8"


def test_inspect_shows_method_and_dtypes() -> None:
    q = inspect_path(SRC)["quantization"]
    assert (q["method"], q["block"], q["stored"], q["dequantized"]) == (
        "mistral-qscale", "tensor", "float8_e4m3fn", "bfloat16",
    )  # fmt: skip
    assert (q["quantized_tensors"], q["dropped_activation_scales"]) == (14, 14)


def test_dequantized_by_the_formula_in_meta_and_hf(tmp_path: Path) -> None:
    stored = load_file(SRC / "consolidated.safetensors")
    result = convert(SRC, tmp_path / "meta", ConvertOptions("meta"))
    assert any("14 mistral-qscale weights dequantized to bfloat16 (--to meta" in n for n in result.notes)
    ours = load_file(tmp_path / "meta" / "consolidated.safetensors")
    weights = [k for k in stored if k.removesuffix("weight") + "qscale_weight" in stored]
    assert len(weights) == 14
    for name in weights:
        scale = stored[name.removesuffix("weight") + "qscale_weight"]
        expected = (stored[name].float() * scale.float()).to(torch.bfloat16)
        assert torch.equal(ours[name].view(torch.uint8), expected.view(torch.uint8)), name
    assert set(ours) == {k for k in stored if "qscale" not in k}
    assert "quantization" not in json.loads((tmp_path / "meta" / "params.json").read_text())
    for out in (tmp_path / "meta", tmp_path / "hf"):
        if not out.exists():
            convert(SRC, out, ConvertOptions("hf"))  # no HF layout holds qscale_weight: dequantized too
        report = verify_paths(SRC, out)
        assert report.verdict().startswith("DEQUANTIZED: 7 of 21 tensors bitwise equal, 14 dequantized weights")
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
