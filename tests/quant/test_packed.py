"""compressed-tensors ``pack-quantized`` sources (W4A16, and 3- and 8-bit): inspected,
dequantized byte-equal to compressed-tensors' own ``PackedQuantizationCompressor.decompress``
and to transformers' dequantizing loader, proven lossless by ``verify``, kept as stored
(``X.weight_packed`` and its scales) where the target holds them; stacked [E, rows, cols]
weights as compressed-tensors packs them.

Fixtures: ``fixtures/ct/w4a16`` (symmetric) and ``fixtures/ct/w4a16-asym`` (zero points
packed along rows; K/V have 20 rows), ``fixtures/ct/w3a16-asym`` (values straddling words,
rows and zero points padded), ``fixtures/ct/w8a16`` (per channel), ``fixtures/ct/w3a16-channel``
(per channel, every row's last word padded: ``weight_shape`` gives the columns), made by
``fixtures/make_ct_fixtures.py``."""

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
W3 = FIXTURES / "ct" / "w3a16-asym"
W8 = FIXTURES / "ct" / "w8a16"
W3C = FIXTURES / "ct" / "w3a16-channel"
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
    for folder, zero, packing in (
        (SYM, "none", "8 int4 a word"),
        (ASYM, "int4 (asymmetric)", "8 int4 a word"),
        (W3, "int3 (asymmetric)", "int3 straddling words (value + 4"),
    ):
        q = inspect_path(folder)["quantization"]
        assert (q["method"], q["block"], q["stored"]) == ("compressed-tensors", [1, 8], "int32")
        assert (q["quantized_tensors"], q["zero_points"], q["dequantized"]) == (14, zero, "bfloat16")
        assert q["packing"].startswith(packing)


@pytest.mark.parametrize(
    "folder", [SYM, ASYM, W3, W8, W3C], ids=["symmetric", "asymmetric", "3-bit", "8-bit", "3-bit-channel"]
)
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


@pytest.mark.parametrize("folder", [ASYM, W3, W8], ids=["4-bit", "3-bit", "8-bit"])
def test_dequantized_equals_transformers_loader(folder: Path, tmp_path: Path) -> None:
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    convert(folder, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), model.state_dict()
    weights = [k for k in theirs if k.endswith("_proj.weight")]
    assert len(weights) == 14
    assert [k for k in weights if not _bytes_equal(ours[k], theirs[k])] == []


@pytest.mark.parametrize(("folder", "tensors"), [(ASYM, 63), (W3, 63), (W3C, 49)], ids=["4-bit", "3-bit", "channel"])
def test_kept_through_hf_bin_and_internal(folder: Path, tensors: int, tmp_path: Path) -> None:
    """Without --dtype: weight_packed, its scales, shape and zero points travel unchanged."""
    path = folder
    for i, to in enumerate(["hf-bin", "internal", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(folder, out).verdict().startswith(f"IDENTICAL: all {tensors} tensors")
        path = out
    assert (path / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert (path / "config.json").read_text() == (folder / "config.json").read_text()


def test_dcp_gets_the_reference_dequantization(tmp_path: Path) -> None:
    result = convert(SYM, tmp_path / "dcp", ConvertOptions("dcp"))
    assert any("14 compressed-tensors weights dequantized to bfloat16 (--to dcp" in n for n in result.notes)
    assert verify_paths(SYM, tmp_path / "dcp").verdict().startswith("DEQUANTIZED: 7 of 21 tensors")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_stacked_weights_equal_compressed_tensors(bits: int) -> None:
    """[E, rows, cols] weights (MoE experts), compressed by compressed-tensors (each matrix packed
    on its own; 20 rows and 36 columns: padded words for every width but 8), asymmetric groups
    of 12: the reference dequantization byte for byte, and (from float32) re-packed to every word."""
    from quant_helpers import compressed_tensors

    compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from ckptkit.formats.tensor_info import TensorInfo
    from ckptkit.quant.packed import PackedCompressedTensors

    args = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": 12, "symmetric": False}
    config = {
        "format": "pack-quantized",
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
    }
    gen = torch.Generator().manual_seed(bits)
    w = (torch.randn(3, 20, 36, generator=gen) * 0.05).to(torch.bfloat16)
    groups = w.float().reshape(3, 20, 3, 12)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).to(torch.bfloat16)
    zero = (-(2 ** (bits - 1)) - (lo / scale.float()).round()).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    state = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero.to(torch.int8)}, scheme)
    theirs = compressor.decompress(state, scheme)["weight"]

    method = PackedCompressedTensors(config, Path("config.json"))
    parts = [f"x.{p}" for p in ("weight_scale", "weight_shape", "weight_zero_point")]
    packed = TensorInfo("x.weight_packed", tuple(state["weight_packed"].shape), "int32", "m.safetensors")
    for name in parts:
        t = state[name.removeprefix("x.")]
        method.check_pair(packed, TensorInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), "m"))
    assert method.model_shape(packed.shape) == (3, 20, 36)
    scales = method.combined(tuple(state[n.removeprefix("x.")] for n in parts))
    ours = method.dequantize(state["weight_packed"], scales, torch.bfloat16)
    assert _bytes_equal(ours, theirs)
    exact = method.dequantize(state["weight_packed"], scales, torch.float32)  # bf16 rounds 8-bit x bf16 products
    assert torch.equal(method.requantize(exact, scales), state["weight_packed"])


@pytest.mark.parametrize(
    ("folder", "module", "shape", "says"),
    [
        (
            W8,
            "self_attn.k_proj",
            [20, 36],
            r"k_proj.weight_shape is \[20, 36\], but .*k_proj.weight_packed \[20, 10\] holds rows of 37 to 40 int8",
        ),
        (
            W3C,
            "self_attn.o_proj",
            [40, 39],
            r"q_proj.weight_shape: packed weights of shape \[40, 4\] hold 39 and 40 columns; not read",
        ),
    ],
    ids=["too-few", "two-counts"],
)
def test_per_channel_columns_the_words_do_not_settle_are_one_line(
    folder: Path, module: str, shape: list[int], says: str, tmp_path: Path
) -> None:
    """Per channel, ``weight_shape`` says how many values a row's words hold (the last one
    padded): one its words cannot hold (int8 rows of 10 words: 37 to 40 values), or two
    counts for one packed shape, is refused in one line naming it, nothing written."""
    import shutil

    from safetensors.torch import save_file

    from ckptkit.errors import CkptkitError

    src = shutil.copytree(folder, tmp_path / "src")
    t = load_file(src / "model.safetensors")
    k = f"model.layers.0.{module}.weight_shape"
    t[k] = torch.tensor(shape)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CkptkitError, match=says) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
