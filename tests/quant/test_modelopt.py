"""modelopt FP8 sources (``quant_method: "modelopt"``, ``quant_algo: "FP8"``): inspected,
dequantized by modelopt's published formula (``e4m3 x weight_scale``, float32, one
rounding), proven lossless by ``verify``, kept as stored through every format that holds
them (a per-tensor scale survives any row order, DCP's included).

Fixture: ``fixtures/modelopt/fp8`` (``fixtures/make_modelopt_fixtures.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path
from ckptkit.verify import verify_paths

from conftest import FIXTURES

FP8 = FIXTURES / "modelopt" / "fp8"


def test_inspect_shows_method_and_dtypes() -> None:
    q = inspect_path(FP8)["quantization"]
    assert (q["method"], q["block"], q["stored"], q["scales"]) == (
        "modelopt", "tensor", "float8_e4m3fn", "float32 per tensor",
    )  # fmt: skip
    assert (q["quantized_tensors"], q["dropped_activation_scales"]) == (12, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantized_by_the_published_formula(dtype: str, tmp_path: Path) -> None:
    convert(FP8, tmp_path / "out", ConvertOptions("hf", dtype=dtype))
    ours, stored = load_file(tmp_path / "out" / "model.safetensors"), load_file(FP8 / "model.safetensors")
    weights = [k for k in stored if k + "_scale" in stored]
    assert len(weights) == 12
    for name in weights:
        expected = (stored[name].float() * stored[name + "_scale"].float()).to(getattr(torch, dtype))
        assert torch.equal(ours[name].view(torch.uint8), expected.view(torch.uint8)), name
    excluded = "model.layers.1.mlp.down_proj.weight"  # exclude_modules: as stored (cast by --dtype)
    assert torch.equal(ours[excluded], stored[excluded].to(getattr(torch, dtype)))
    if dtype == "bfloat16":  # the unquantized tensors unchanged
        report = verify_paths(FP8, tmp_path / "out")
        assert report.verdict().startswith("DEQUANTIZED: 9 of 21 tensors bitwise equal, 12 dequantized weights")


def test_kept_through_every_folder_format(tmp_path: Path) -> None:
    path = FP8
    for i, to in enumerate(["dcp", "internal", "hf-bin", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(FP8, out).verdict().startswith("IDENTICAL: all 33 tensors")
        path = out
    back, stored = load_file(path / "model.safetensors"), load_file(FP8 / "model.safetensors")
    assert set(stored) - set(back) == {k for k in stored if k.endswith(("input_scale", "k_scale", "v_scale"))}
    assert json.loads((path / "config.json").read_text()) == json.loads((FP8 / "config.json").read_text())


def test_fp8_weights_under_an_nvfp4_config_are_refused_in_one_line(tmp_path: Path) -> None:
    src = shutil.copytree(FP8, tmp_path / "src")
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"]["quant_algo"] = "NVFP4"
    (src / "config.json").write_text(json.dumps(doc))
    message = r"_proj.weight is float8_e4m3fn but has a scale .*_proj.weight_scale; modelopt weights are uint8"
    with pytest.raises(CkptkitError, match=message):
        convert(src, tmp_path / "out", ConvertOptions("hf"))
    assert not (tmp_path / "out").exists()
