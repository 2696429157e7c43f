"""MXFP4 sources (``quant_method: "mxfp4"``, gpt-oss's experts as OpenAI releases them):
inspected, dequantized byte-equal to transformers' ``Mxfp4Config(dequantize=True)`` loader,
re-quantized with their own scales back to every source byte, kept as stored through HF,
hf-bin, internal and DCP, and refused in one line when broken.

Fixture: ``fixtures/mxfp4/gpt_oss`` (``fixtures/make_mxfp4_fixtures.py``: a transformers-built
gpt-oss, its experts quantized by the published MX recipe)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.inspection import inspect_path
from ckptkit.quant.mxfp4 import MXFP4
from ckptkit.verify import verify_paths

from conftest import FIXTURES

SRC = FIXTURES / "mxfp4" / "gpt_oss"
BLOCKS = "model.layers.1.mlp.experts.down_proj_blocks"
SCALES = "model.layers.1.mlp.experts.down_proj_scales"


def stored() -> dict[str, torch.Tensor]:
    return load_file(SRC / "model.safetensors")


def method() -> MXFP4:
    return MXFP4(json.loads((SRC / "config.json").read_text())["quantization_config"], SRC / "config.json")


def test_inspect_shows_method_blocks_and_dtypes() -> None:
    q = inspect_path(SRC)["quantization"]
    assert (q["method"], q["block"], q["stored"], q["scales"]) == ("mxfp4", [1, 32], "uint8", "e8m0 (uint8)")
    assert (q["dequantized"], q["quantized_tensors"]) == ("bfloat16", 4)  # gate_up and down in 2 layers


def test_fixture_holds_every_e2m1_code_and_a_spread_of_exponents() -> None:
    t = stored()
    blocks = [v for k, v in t.items() if k.endswith("_blocks")]
    codes = torch.cat([torch.cat([(b & 15).flatten(), (b >> 4).flatten()]) for b in blocks])
    assert sorted(codes.unique().tolist()) == list(range(16))
    exponents = torch.cat([v.flatten() for k, v in t.items() if k.endswith("_scales")]).int() - 127
    assert exponents.min() <= -15 and exponents.max() >= 15 and exponents.unique().numel() > 30


def test_dequantized_equals_transformers_loader(tmp_path: Path) -> None:
    """transformers holds the experts as [E, cols, rows]: so does the dequantized output, every
    tensor of it byte-equal to the loader's; ``verify`` re-quantizes it back to every source byte."""
    from quant_helpers import mxfp4_dequantized

    theirs = mxfp4_dequantized(SRC)
    convert(SRC, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert sorted(ours) == sorted(theirs)
    equal = [
        k
        for k, v in theirs.items()
        if ours[k].dtype == v.dtype and torch.equal(ours[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
    ]
    assert len(equal) == len(theirs) == 37
    report = verify_paths(SRC, tmp_path / "out")
    assert report.verdict().startswith("DEQUANTIZED: 33 of 37 tensors bitwise equal, 4 dequantized weights")
    assert report.exit_code() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_requantized_with_the_source_scales_every_byte_comes_back(dtype: torch.dtype) -> None:
    t, m = stored(), method()
    for name in [k for k in t if k.endswith("_blocks")]:
        scale = t[m.scale_name(name)]
        assert torch.equal(m.requantize(m.dequantize(t[name], scale, dtype), scale), t[name]), name


def test_quantize_is_the_published_recipe_of_the_fixture() -> None:
    """Quantizing the dequantized values again gives the release's own scales and blocks."""
    t, m = stored(), method()
    for name in [k for k in t if k.endswith("_blocks")]:
        blocks, scales = m.quantize(m.dequantize(t[name], t[m.scale_name(name)], torch.float32))
        assert torch.equal(blocks, t[name]) and torch.equal(scales, t[m.scale_name(name)]), name


@pytest.mark.parametrize("via", [("hf-bin", "internal", "hf"), ("dcp", "hf")])
def test_kept_as_stored_through_every_folder_format(via: tuple[str, ...], tmp_path: Path) -> None:
    src = SRC
    for i, to in enumerate(via):
        convert(src, tmp_path / str(i), ConvertOptions(to))
        src = tmp_path / str(i)
    for name in ("model.safetensors", "config.json"):
        assert (src / name).read_bytes() == (SRC / name).read_bytes(), name


def _broken(tmp: Path, **tensors: torch.Tensor | None) -> Path:
    src = shutil.copytree(SRC, tmp / "src")
    t = stored()
    for name, value in tensors.items():
        if value is None:
            del t[name]
        else:
            t[name] = value
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    return src


def _nan(scale: torch.Tensor) -> torch.Tensor:
    bad = scale.clone()
    bad[0, 1, 0] = 0xFF
    return bad


BROKEN = {
    "missing scales": ({SCALES: None}, rf"{BLOCKS} is quantized \(uint8\) but has no scale {SCALES}"),
    "scale shape": ({SCALES: torch.zeros(3, 96, 2, dtype=torch.uint8)}, rf"{SCALES} is uint8 \[3, 96, 2\], but"),
    "blocks shape": ({BLOCKS: torch.zeros(3, 96, 1, 8, dtype=torch.uint8)}, rf"{BLOCKS} is \[3, 96, 1, 8\]"),
    "e8m0 NaN": ({SCALES: _nan(stored()[SCALES])}, rf"{SCALES}: 1 scale\(s\) are the e8m0 NaN code 0xFF"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_sources_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    changes, message = BROKEN[case]
    src = _broken(tmp_path, **changes)
    with pytest.raises(CkptkitError, match=message) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_gguf_keeps_the_experts_mxfp4_in_ggml_block_order(tmp_path: Path) -> None:
    """The experts go to GGUF as GGML's MXFP4 (not re-quantized): the ``gguf`` package's own
    MXFP4 dequantization of each gives the source's values (dequantized as transformers does),
    gate and up the even and odd rows of ``gate_up_proj``; the rest as ``--dtype`` says."""
    import gguf
    import numpy as np
    from gguf import GGUFReader

    convert(SRC, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre="gpt-4o", dtype="float32"))
    reader = GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    assert [t.name for t in reader.tensors[:3]] == [f"blk.0.ffn_{p}_exps.weight" for p in ("down", "gate", "up")]
    t, m = stored(), method()
    for layer in (0, 1):
        down = f"model.layers.{layer}.mlp.experts.down_proj_blocks"
        gate_up = f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"
        want = {"down": m.dequantize(t[down], t[m.scale_name(down)], torch.float32)}
        values = m.dequantize(t[gate_up], t[m.scale_name(gate_up)], torch.float32)
        want |= {"gate": values[:, 0::2], "up": values[:, 1::2]}
        for proj, values in want.items():
            got = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert got.tensor_type.name == "MXFP4"
            theirs = gguf.quants.dequantize(got.data, gguf.GGMLQuantizationType.MXFP4)
            assert np.array_equal(theirs, values.numpy()), (layer, proj)  # ggml reads code 8 (-0) as +0
    assert tensors["token_embd.weight"].tensor_type.name == "F32"


def test_ggml_block_order_undone_gives_the_release_bytes() -> None:
    """The repacking read back (:func:`release_blocks`) gives every blocks and scales byte."""
    from ckptkit.formats.gguf.mxfp4 import ggml_blocks, release_blocks

    t = stored()
    for name in [k for k in t if k.endswith("_blocks")]:
        scales = t[name.removesuffix("_blocks") + "_scales"]
        packed = ggml_blocks(t[name], scales)
        assert packed.shape == (*scales.shape[:-1], scales.shape[-1] * 17)
        blocks, back = release_blocks(packed)
        assert torch.equal(blocks, t[name]) and torch.equal(back, scales), name


def test_gguf_with_a_llama_quantize_type_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match=r"--dtype Q4_K_M: ckptkit does not re-quantize MXFP4 experts") as err:
        convert(SRC, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre="gpt-4o", dtype="Q4_K_M"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m.gguf").exists()
