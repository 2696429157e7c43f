"""modelopt NVFP4 sources (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``): inspected,
dequantized by modelopt's recipe (``NVFP4QTensor.dequantize``: the block's float32 scale
``e4m3 x weight_scale_2``, times the e2m1 value, one rounding to the output dtype), proven
lossless by ``verify``, kept as stored through hf, hf-bin and internal (DCP, whose layout
moves rows across the per-row scales, gets them dequantized).

The element order and the e4m3 block scales are checked against llama.cpp's converter,
whose ``_nvfp4_pack`` repacks the same tensors into GGUF's NVFP4 type (decoded by the gguf
package); the arithmetic against the formula written out here. Measured on the fixture:
llama.cpp's order, ``(e2m1 x e4m3) x weight_scale_2``, differs from modelopt's in float32 on
3620 of 49152 values, on none once rounded to bfloat16 or float16.

Fixture: ``fixtures/modelopt/nvfp4`` (``fixtures/make_nvfp4_fixtures.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from nvfp4_helpers import llama_cpp_pack, modelopt_dequantized
from safetensors.torch import load_file, save_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path
from ckptkit.quant import nvfp4
from ckptkit.verify import verify_paths

from conftest import FIXTURES

NV = FIXTURES / "modelopt" / "nvfp4"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _quantized(stored: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in stored if k + "_scale" in stored and k + "_scale_2" in stored]


def test_inspect_shows_method_and_dtypes() -> None:
    q = inspect_path(NV)["quantization"]
    assert (q["method"], q["block"], q["stored"], q["scales"]) == (
        "modelopt", [1, 16], "uint8", "float8_e4m3fn per 16 x float32 weight_scale_2",
    )  # fmt: skip
    assert (q["quantized_tensors"], q["dropped_activation_scales"]) == (12, 16)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dequantized_by_modelopts_recipe(dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight made and written a row at a time."""
    monkeypatch.setattr(nvfp4, "CHUNK_ELEMENTS", 1)
    convert(NV, tmp_path / "out", ConvertOptions("hf", dtype=dtype))
    ours, stored = load_file(tmp_path / "out" / "model.safetensors"), load_file(NV / "model.safetensors")
    weights = _quantized(stored)
    assert len(weights) == 12
    for name in weights:
        wide = modelopt_dequantized(stored[name], stored[name + "_scale"], stored[name + "_scale_2"])
        assert torch.equal(ours[name].view(torch.uint8), wide.to(DTYPES[dtype]).view(torch.uint8)), name
    excluded = "model.layers.1.mlp.down_proj.weight"  # exclude_modules: as stored (cast by --dtype)
    assert torch.equal(ours[excluded], stored[excluded].to(DTYPES[dtype]))
    if dtype == "bfloat16":
        report = verify_paths(NV, tmp_path / "out")
        assert report.verdict().startswith("DEQUANTIZED: 9 of 21 tensors bitwise equal, 12 dequantized weights")


def test_element_order_and_block_scales_as_llama_cpp_reads_them(llama_cpp: Path, tmp_path: Path) -> None:
    import gguf

    pack = llama_cpp_pack(llama_cpp)
    stored = load_file(NV / "model.safetensors")
    convert(NV, tmp_path / "out", ConvertOptions("hf", dtype="float32"))
    ours = load_file(tmp_path / "out" / "model.safetensors")
    values = differ = 0
    for name in _quantized(stored):
        raw, shape = pack(stored[name], stored[name + "_scale"])
        blocks = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.NVFP4)  # e2m1 x e4m3, exact
        theirs = torch.from_numpy(blocks.astype(np.float32)).reshape(shape)
        scale_2 = stored[name + "_scale_2"]
        assert torch.equal(ours[name], modelopt_dequantized(stored[name], stored[name + "_scale"], scale_2))
        unit = modelopt_dequantized(stored[name], stored[name + "_scale"], torch.tensor(1.0))
        assert torch.equal(unit, theirs), name  # same element order, same e4m3 scales
        llama_order = theirs * scale_2  # llama.cpp multiplies by weight_scale_2 at inference
        values += theirs.numel()
        differ += int((llama_order != ours[name]).sum())
        assert torch.equal(llama_order.to(torch.bfloat16), ours[name].to(torch.bfloat16)), name
    assert (values, differ) == (49152, 3620)


def test_kept_through_hf_bin_internal_and_hf(tmp_path: Path) -> None:
    path = NV
    for i, to in enumerate(["hf-bin", "internal", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(NV, out).verdict().startswith("IDENTICAL: all 45 tensors")
        path = out
    back, stored = load_file(path / "model.safetensors"), load_file(NV / "model.safetensors")
    assert set(stored) - set(back) == {k for k in stored if k.endswith(("input_scale", "k_scale", "v_scale"))}
    assert all(
        back[k].dtype == stored[k].dtype
        and torch.equal(back[k].reshape(-1).view(torch.uint8), stored[k].reshape(-1).view(torch.uint8))
        for k in back
    )
    assert json.loads((path / "config.json").read_text()) == json.loads((NV / "config.json").read_text())


def test_dcp_gets_them_dequantized(tmp_path: Path) -> None:
    result = convert(NV, tmp_path / "dcp", ConvertOptions("dcp"))
    assert any("12 modelopt weights dequantized to bfloat16 (--to dcp" in n for n in result.notes)
    assert verify_paths(NV, tmp_path / "dcp").verdict().startswith("DEQUANTIZED: 9 of 21 tensors bitwise equal")


def _hf_quant_config_only(tmp_path: Path, producer: str = "modelopt") -> Path:
    """The fixture as older modelopt exports ship it: the quantization in hf_quant_config.json only."""
    src = shutil.copytree(NV, tmp_path / "src")
    doc = json.loads((src / "config.json").read_text())
    q = doc.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(doc))
    fields = {k: v for k, v in q.items() if k not in ("producer", "quant_method")}
    (src / "hf_quant_config.json").write_text(
        json.dumps({"producer": {**q["producer"], "name": producer}, "quantization": fields})
    )
    return src


def test_hf_quant_config_json_alone_is_read(tmp_path: Path) -> None:
    src = _hf_quant_config_only(tmp_path)
    convert(src, tmp_path / "kept", ConvertOptions("hf"))
    assert verify_paths(src, tmp_path / "kept").verdict().startswith("IDENTICAL: all 45 tensors")
    kept = json.loads((tmp_path / "kept" / "config.json").read_text())["quantization_config"]
    assert kept == json.loads((NV / "config.json").read_text())["quantization_config"]  # as transformers writes it
    convert(src, tmp_path / "bf16", ConvertOptions("hf", dtype="bfloat16"))
    assert not (tmp_path / "bf16" / "hf_quant_config.json").exists()  # it would say the bf16 weights are NVFP4
    assert verify_paths(src, tmp_path / "bf16").verdict().startswith("DEQUANTIZED: 9 of 21 tensors")


def test_hf_quant_config_json_of_another_producer_is_refused(tmp_path: Path) -> None:
    src = _hf_quant_config_only(tmp_path, producer="other")
    with pytest.raises(CkptkitError, match=r"hf_quant_config.json: not a modelopt export's quantization"):
        convert(src, tmp_path / "out", ConvertOptions("hf"))
    assert not (tmp_path / "out").exists()


def test_zero_block_scales_cannot_give_their_codes_back(tmp_path: Path) -> None:
    """A block whose e4m3 scale is 0 dequantizes to zeros whatever its codes: re-quantizing
    cannot give them back, so verify names that weight (DIFFERENT, exit 1) and says what
    differs: the stored bytes of those two blocks (16, every one holding a non-zero code), not
    the values, which are the dequantization all the same; the others still proven."""
    src = shutil.copytree(NV, tmp_path / "src")
    stored = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    scale = stored[name + "_scale"].view(torch.uint8).clone()
    scale[0, 0] = scale[3, 1] = 0
    stored[name + "_scale"] = scale.view(torch.float8_e4m3fn)
    save_file(stored, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    report = verify_paths(src, tmp_path / "out")
    verdict = (
        "DIFFERENT: 9 of 21 tensors bitwise equal, 1 dequantized exactly from codes that do not all come back, 11 "
    )
    assert report.verdict().startswith(verdict) and report.exit_code() == 1
    assert [d.name_a for d in report.differences if d.kind not in ("dequantized",)] == [name]
    lost = torch.cat([stored[name][0, :8], stored[name][3, 8:16]])
    assert bool(((lost & 0x77) != 0).all())  # a non-zero code in every byte: none comes back as 0
    (codes,) = [d.describe() for d in report.differences if d.kind == "codes"]
    assert f"dequantized exactly, but {lost.numel()} of {stored[name].numel()} stored bytes do not come back" in codes
    assert "max abs diff" not in codes
    ours = load_file(tmp_path / "out" / "model.safetensors")[name]
    assert not ours[0, :16].any() and not ours[3, 16:32].any()
    ref = modelopt_dequantized(stored[name], stored[name + "_scale"], stored[name + "_scale_2"])
    assert torch.equal(ours.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
