"""Broken quantized sources of every method ckptkit reads besides block FP8 (whose table is
in test_fp8.py): fuzzed scales, truncated scale grids, configs that lie. Each is one line
naming the tensor or the config field, and nothing is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

CT = FIXTURES / "ct" / "fp8"
INT8 = FIXTURES / "ct" / "int8"
W4 = FIXTURES / "ct" / "w4a16-asym"
MO = FIXTURES / "modelopt" / "fp8"
NV = FIXTURES / "modelopt" / "nvfp4"
MI = FIXTURES / "mistral-fp8"
WQ = "layers.0.attention.wq"
Q = "model.layers.0.self_attn.q_proj"  # per channel in ct/fp8
K = "model.layers.0.self_attn.k_proj"  # 20 rows: int4 groups of 8 in ct/w4a16-asym
GATE = "model.layers.0.mlp.gate_proj"  # 16 x 16 blocks in ct/fp8


def _stored(folder: Path, name: str) -> torch.Tensor:
    return load_file(next(folder.glob("*.safetensors")))[name].clone()


def _poked(folder: Path, name: str, value: float) -> torch.Tensor:
    t = _stored(folder, name)
    t.view(-1)[min(1, t.numel() - 1)] = value
    return t


def _w4_scale(value: float) -> torch.Tensor:
    return _poked(W4, f"{K}.weight_scale", value)


def _w4_groups(**weights: Any) -> dict[str, Any]:
    groups = json.loads((W4 / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["weights"].update(weights)
    return groups  # type: ignore[no-any-return]


def _ct_scale(value: float) -> torch.Tensor:
    return _poked(CT, f"{Q}.weight_scale", value)


# case: (fixture, tensors to replace (None: delete), quantization_config changes, message)
BROKEN: dict[str, tuple[Path, dict[str, torch.Tensor | None], dict[str, Any], str]] = {
    "ct nan scale": (
        CT,
        {f"{Q}.weight_scale": _ct_scale(float("nan"))},
        {},
        rf"{Q}.weight_scale: 1 scale\(s\) are NaN",
    ),
    "ct inf scale": (
        CT,
        {f"{Q}.weight_scale": _ct_scale(float("inf"))},
        {},
        rf"{Q}.weight_scale: 1 scale\(s\) are NaN",
    ),
    "ct negative scale": (CT, {f"{Q}.weight_scale": _ct_scale(-1.0)}, {}, rf"{Q}.weight_scale: negative scales"),
    "ct channel scale shape": (
        CT,
        {f"{Q}.weight_scale": torch.ones(41, 1, dtype=torch.bfloat16)},
        {},
        rf"{Q}.weight_scale is \[41, 1\], but {Q}.weight \[40, 40\] in \[1, 40\] blocks needs \[40, 1\]",
    ),
    "ct truncated block grid": (
        CT,
        {f"{GATE}.weight_scale": _stored(CT, f"{GATE}.weight_scale")[:3]},
        {},
        rf"{GATE}.weight_scale is \[3, 3\], but {GATE}.weight \[56, 40\] in \[16, 16\] blocks needs \[4, 3\]",
    ),
    "ct scale dtype": (
        CT,
        {f"{Q}.weight_scale": torch.ones(40, 1, dtype=torch.int32)},
        {},
        rf"{Q}.weight_scale is int32; compressed-tensors weight scales are float32 or bfloat16 or float16",
    ),
    "ct no scale": (
        CT,
        {f"{Q}.weight_scale": None},
        {},
        rf"{Q}.weight is quantized \(float8_e4m3fn\) but has no scale",
    ),
    "ct weight not quantized": (
        CT,
        {f"{Q}.weight": torch.zeros(40, 40, dtype=torch.bfloat16)},
        {},
        rf"{Q}.weight is bfloat16 but has a scale {Q}.weight_scale; compressed-tensors weights are float8_e4m3fn",
    ),
    "ct says float, stores int8": (
        INT8,
        {},
        {"config_groups": json.loads((CT / "config.json").read_text())["quantization_config"]["config_groups"]},
        r"is int8 but has a scale .*weight_scale; compressed-tensors weights are float8_e4m3fn",
    ),
    "ct pack-quantized 9-bit": (
        W4,
        {},
        {"config_groups": _w4_groups(num_bits=9)},
        r"group_0: pack-quantized 9-bit int weights: compressed-tensors packs 1- to 8-bit int",
    ),
    "ct bitmask format": (
        INT8,
        {},
        {"format": "sparse-bitmask"},
        r"format 'sparse-bitmask' \(group_0\): ckptkit reads",
    ),
    "ct4 no scale": (W4, {f"{K}.weight_scale": None}, {}, rf"{K}.weight has .* but no scale {K}.weight_scale"),
    "ct4 no zero point": (W4, {f"{K}.weight_zero_point": None}, {}, rf"but no scale {K}.weight_zero_point"),
    "ct4 no packed weight": (
        W4,
        {f"{K}.weight_packed": None},
        {},
        rf"{K}.weight_s\w+ is a scale, but there is no tensor {K}.weight_packed",
    ),
    "ct4 packed weight without scales": (
        W4,
        {f"{K}.weight_scale": None, f"{K}.weight_shape": None, f"{K}.weight_zero_point": None},
        {},
        rf"{K}.weight_packed is quantized \(int32\) but has no scale {K}.weight_scale",
    ),
    "ct4 scale shape": (
        W4,
        {f"{K}.weight_scale": torch.ones(20, 4, dtype=torch.bfloat16)},
        {},
        rf"{K}.weight_scale is \[20, 4\], but {K}.weight_packed \[20, 5\] \(20 x 40 int4, groups of 8\) "
        r"needs \[20, 5\]",
    ),
    "ct4 zero point shape": (
        W4,
        {f"{K}.weight_zero_point": torch.zeros(20, 5, dtype=torch.int32)},
        {},
        rf"{K}.weight_zero_point is \[20, 5\], .* needs \[3, 5\]",
    ),
    "ct4 nan scale": (
        W4,
        {f"{K}.weight_scale": _w4_scale(float("nan"))},
        {},
        rf"{K}.weight_scale: 1 scale\(s\) are NaN",
    ),
    "ct4 weight_shape lies": (
        W4,
        {f"{K}.weight_shape": torch.tensor([20, 32])},
        {},
        rf"{K}.weight_shape is \[20, 32\], but the packed weight holds \[20, 40\]",
    ),
    "ct4 groups not whole": (
        W4,
        {},
        {"config_groups": _w4_groups(group_size=16)},
        r"down_proj.weight_packed holds 7 words of int4 a row \(49 to 56 columns\), not whole groups of 16; not read",
    ),
    "ct frozen": (INT8, {}, {"quantization_status": "frozen"}, r"quantization_status 'frozen': the weights are not"),
    "ct no target": (
        CT,
        {},
        {
            "ignore": ["lm_head"],
            "config_groups": {
                "g": {
                    "targets": ["re:.*self_attn.*"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                }
            },
        },  # fmt: skip
        r"model.layers.0.mlp.down_proj.weight is stored quantized, but no config group targets",
    ),
    "ct asymmetric": (
        INT8,
        {},
        {
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": False},
                }
            }
        },  # fmt: skip
        r"g: asymmetric weights \(zero points\): ckptkit reads symmetric ones",
    ),
    "ct 4-bit naive": (
        INT8,
        {},
        {
            "config_groups": {
                "g": {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "channel"}}
            }
        },  # fmt: skip
        r"g: 4-bit int weights: ckptkit reads 8-bit float or int",
    ),
    "unknown method": (INT8, {}, {"quant_method": "awq"}, r"quant_method 'awq', which ckptkit does not read"),
    "modelopt nan scale": (
        MO,
        {f"{Q}.weight_scale": torch.tensor(float("nan"))},
        {},
        rf"{Q}.weight_scale: 1 scale\(s\) are NaN or infinite",
    ),
    "modelopt scale shape": (
        MO,
        {f"{Q}.weight_scale": torch.ones(2)},
        {},
        rf"{Q}.weight_scale is \[2\], but {Q}.weight \[40, 40\] in \[40, 40\] blocks needs \[1, 1\]",
    ),
    "modelopt scale dtype": (
        MO,
        {f"{Q}.weight_scale": torch.tensor(0.5, dtype=torch.bfloat16)},
        {},
        rf"{Q}.weight_scale is bfloat16; modelopt weight scales are float32",
    ),
    "modelopt excluded but quantized": (
        MO,
        {},
        {"exclude_modules": ["lm_head", "model.layers.*.self_attn.q_proj"]},
        rf"exclude_modules lists {Q}.weight, which is stored quantized",
    ),
    "modelopt unknown algo": (
        MO,
        {},
        {"quant_algo": "W4A8_AWQ"},
        r"modelopt quant_algo 'W4A8_AWQ': ckptkit reads FP8, NVFP4; nothing converted",
    ),
    "nvfp4 no weight_scale_2": (
        NV,
        {f"{Q}.weight_scale_2": None},
        {},
        rf"{Q}.weight has {Q}.weight_scale but no scale {Q}.weight_scale_2; modelopt weights need",
    ),
    "nvfp4 no weight_scale": (NV, {f"{Q}.weight_scale": None}, {}, rf"{Q}.weight has {Q}.weight_scale_2 but no"),
    "nvfp4 no scales": (
        NV,
        {f"{Q}.weight_scale": None, f"{Q}.weight_scale_2": None},
        {},
        rf"{Q}.weight is quantized \(uint8\) but has no scale {Q}.weight_scale; refusing to copy raw",
    ),
    "nvfp4 scale shape": (
        NV,
        {f"{Q}.weight_scale": _stored(NV, f"{Q}.weight_scale")[:, :3].contiguous()},
        {},
        rf"{Q}.weight_scale is \[64, 3\], but {Q}.weight uint8 \[64, 32\] \(64 x 64 values\) needs \[64, 4\]",
    ),
    "nvfp4 scale dtype": (
        NV,
        {f"{Q}.weight_scale": _stored(NV, f"{Q}.weight_scale").float()},
        {},
        rf"{Q}.weight_scale is float32; NVFP4 weight scales are float8_e4m3fn",
    ),
    "nvfp4 nan block scale": (
        NV,
        {f"{Q}.weight_scale": _stored(NV, f"{Q}.weight_scale").view(torch.uint8).fill_(0x7F).view(torch.float8_e4m3fn)},
        {},
        rf"{Q}.weight_scale: 256 scale\(s\) are NaN or infinite",
    ),
    "nvfp4 global scale shape": (
        NV,
        {f"{Q}.weight_scale_2": torch.ones(2)},
        {},
        rf"{Q}.weight_scale_2 is float32 \[2\]; an NVFP4 weight_scale_2 is one float32",
    ),
    "nvfp4 negative global scale": (
        NV,
        {f"{Q}.weight_scale_2": torch.tensor(-1.0)},
        {},
        rf"{Q}.weight_scale_2: negative scales",
    ),
    "nvfp4 packed size": (
        NV,
        {f"{Q}.weight": _stored(NV, f"{Q}.weight")[:, :28].contiguous()},
        {},
        rf"{Q}.weight is uint8 \[64, 28\]: NVFP4 weights are matrices of rows of whole 16-value blocks",
    ),
    "nvfp4 group size": (NV, {}, {"group_size": 32}, r"NVFP4 group_size 32: NVFP4 scales blocks of 16"),
    "mistral inf qscale": (
        MI,
        {f"{WQ}.qscale_weight": torch.tensor(float("inf"))},
        {},
        rf"{WQ}.qscale_weight: 1 scale\(s\) are NaN or infinite",
    ),
    "mistral qscale shape": (
        MI,
        {f"{WQ}.qscale_weight": torch.ones(64, 1)},
        {},
        rf"{WQ}.qscale_weight is \[64, 1\], but {WQ}.weight \[64, 64\] in \[64, 64\] blocks needs \[1, 1\]",
    ),
    "mistral weight not fp8": (
        MI,
        {f"{WQ}.weight": torch.zeros(64, 64, dtype=torch.bfloat16)},
        {},
        rf"{WQ}.weight is bfloat16 but has a scale {WQ}.qscale_weight; mistral-qscale weights are float8_e4m3fn",
    ),
    "mistral unknown qformat": (MI, {}, {"qformat_weight": "int4"}, r"quantization.qformat_weight 'int4'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_sources_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    fixture, changes, config, message = BROKEN[case]
    src = shutil.copytree(fixture, tmp_path / "src")
    if changes:
        t = load_file(next(src.glob("*.safetensors")))
        for name, value in changes.items():
            if value is None:
                del t[name]
            else:
                t[name] = value
        weights = next(src.glob("*.safetensors"))
        save_file(t, weights, metadata={"format": "pt"})
    if config:
        meta = (src / "params.json").exists()  # Mistral's: params.json's quantization
        doc = json.loads((src / ("params.json" if meta else "config.json")).read_text())
        doc["quantization" if meta else "quantization_config"].update(config)
        (src / ("params.json" if meta else "config.json")).write_text(json.dumps(doc))
    with pytest.raises(CkptkitError, match=message) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_source_cut_short_while_a_scale_is_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The safetensors file shrinks after its header was read, before a scale's bytes are
    (read without torch): one line naming the scale, nothing written."""
    import ckptkit.quant

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "fp8" / "llama-overhang", src)
    read_spans = ckptkit.quant.read_spans

    def cut_first(spans: Any) -> bytes:
        (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:200])
        return read_spans(spans)

    monkeypatch.setattr(ckptkit.quant, "read_spans", cut_first)
    with pytest.raises(CkptkitError, match=r"weight_scale_inv: changed while it was read \(shorter than its size\)"):
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert not (tmp_path / "out").exists()
