"""Block-FP8 sources (``quant_method: "fp8"``): inspected, dequantized byte-equal to
transformers' dequantizing loader, proven lossless by ``verify``, kept as stored where the
target holds them, written by ``--dtype fp8``, and refused in one line when they are broken.

Fixtures: ``fixtures/fp8/`` (``fixtures/make_fp8_fixtures.py``: transformers' own FP8
quantizer, and the published formula for blocks that overhang the tensor)."""

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
from ckptkit.quant import scaled
from ckptkit.verify import verify_paths

from conftest import FIXTURES

QWEN3 = FIXTURES / "fp8" / "qwen3"
LLAMA = FIXTURES / "fp8" / "llama-overhang"
SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"
WEIGHT = "model.layers.0.mlp.down_proj.weight"


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def transformers_dequantized(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' dequantizing FP8 loader (``FineGrainedFP8Config(dequantize=True)``), on CPU."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FineGrainedFP8Config(weight_block_size=[16, 16], dequantize=True), dtype=dtype
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_inspect_shows_method_blocks_and_dtypes() -> None:
    q = inspect_path(QWEN3)["quantization"]
    assert q["method"] == "fp8"
    assert q["block"] == [16, 16]
    assert q["stored"] == "float8_e4m3fn"
    assert q["scales"] == "float32"
    assert q["dequantized"] == "bfloat16"
    assert q["quantized_tensors"] == 14  # 7 linear weights in each of 2 layers


@pytest.mark.parametrize(("to", "dtype"), [("hf", "bfloat16"), ("hf", "float32"), ("hf-bin", "bfloat16")])
def test_dequantized_equals_transformers_loader(
    to: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each weight made and written in pieces of a few rows (hf-bin: its zip CRCs over them)."""
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 256)
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 512)
    convert(QWEN3, tmp_path / "out", ConvertOptions(to, dtype=dtype))
    if to == "hf-bin":  # read back by ckptkit, which checks each record's CRC-32
        convert(tmp_path / "out", tmp_path / "st", ConvertOptions("hf"))
    ours = tensors(tmp_path / ("st" if to == "hf-bin" else "out"))
    ref = transformers_dequantized(QWEN3, getattr(torch, dtype))
    assert set(ours) == set(ref)  # the scales are gone, every weight is there
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype, name
        assert torch.equal(ours[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config


def test_verify_proves_dequantization_and_names_a_changed_tensor(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(LLAMA, out, ConvertOptions("hf", dtype="bfloat16", verify=True))  # --verify accepts it
    report = verify_paths(LLAMA, out)
    assert report.verdict().startswith("DEQUANTIZED: 7 of 21 tensors bitwise equal, 14 dequantized weights")
    assert report.exit_code() == 0
    t = load_file(out / "model.safetensors")
    w = t["model.layers.1.mlp.up_proj.weight"]
    w.view(-1)[w.view(-1).nonzero()[7]] *= -1  # one value's sign: its source byte no longer comes back
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    report = verify_paths(LLAMA, out)
    assert report.verdict().startswith("DIFFERENT: 7 of 21 tensors bitwise equal, 1 differ in value or shape")
    assert [d.name_a for d in report.differences if d.kind == "values"] == ["model.layers.1.mlp.up_proj.weight"]
    assert report.exit_code() == 1


def test_a_target_without_block_fp8_gets_bfloat16(tmp_path: Path) -> None:
    """Meta's layout does not hold block FP8: the reference dequantization, with a note."""
    result = convert(LLAMA, tmp_path / "out", ConvertOptions("meta"))
    assert "14 fp8 weights dequantized to bfloat16 (--to meta does not hold them as stored)" in "".join(result.notes)
    assert verify_paths(LLAMA, tmp_path / "out").verdict().startswith("DEQUANTIZED: 7 of 21 tensors")


def test_kept_through_hf_bin_internal_and_dcp(tmp_path: Path) -> None:
    """Without --dtype: the FP8 bytes, scales and quantization_config travel unchanged."""
    path = LLAMA
    for i, to in enumerate(["hf-bin", "internal", "dcp", "hf"]):
        out = tmp_path / f"{i}-{to}"
        convert(path, out, ConvertOptions(to))
        assert verify_paths(LLAMA, out).verdict().startswith("IDENTICAL: all 35 tensors")
        path = out
    assert (path / "model.safetensors").read_bytes() == (LLAMA / "model.safetensors").read_bytes()
    assert (path / "config.json").read_text() == (LLAMA / "config.json").read_text()


def test_qwen3_kept_through_hf_bin_and_internal(tmp_path: Path) -> None:
    convert(QWEN3, tmp_path / "bin", ConvertOptions("hf-bin"))
    convert(tmp_path / "bin", tmp_path / "int", ConvertOptions("internal"))
    convert(tmp_path / "int", tmp_path / "back", ConvertOptions("hf"))
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (QWEN3 / name).read_bytes()


def test_dtype_fp8_keeps_an_fp8_source_as_it_is(tmp_path: Path) -> None:
    convert(QWEN3, tmp_path / "fp8", ConvertOptions("hf-bin", dtype="fp8"))
    convert(tmp_path / "fp8", tmp_path / "a", ConvertOptions("hf", dtype="bfloat16"))
    convert(QWEN3, tmp_path / "b", ConvertOptions("hf", dtype="bfloat16"))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_dtype_fp8_writes_a_release_transformers_loads(tmp_path: Path) -> None:
    """A bf16 model quantized by --dtype fp8: DeepSeek's and Qwen's layout (e4m3 linear
    weights, f32 128 x 128 scales, bf16 norms, embeddings and lm_head), loaded by
    transformers; its dequantization is ours, and verify says QUANTIZED."""
    src = FIXTURES / "hf" / "qwen3"
    out = tmp_path / "fp8"
    convert(src, out, ConvertOptions("hf", dtype="fp8", max_shard_size="10GB"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    }  # fmt: skip
    stored = tensors(out)
    kinds = {k: v.dtype for k, v in stored.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert kinds["model.layers.0.self_attn.q_proj.weight_scale_inv"] == torch.float32
    assert stored["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (1, 1)
    plain = [k for k, d in kinds.items() if d == torch.bfloat16]
    assert all("norm" in k or "embed" in k for k in plain), plain
    # transformers' loader refuses weights whose dims do not divide the scale grid; these
    # tiny dims are one block, so it loads them and dequantizes as ckptkit does
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    convert(out, tmp_path / "deq", ConvertOptions("hf", dtype="bfloat16"))
    ours = tensors(tmp_path / "deq")
    for name, t in model.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied
        assert torch.equal(ours[key], t), name
    report = verify_paths(src, out)
    assert report.verdict().startswith("QUANTIZED: ")
    assert report.exit_code() == 1


def test_activation_scales_are_dropped_with_a_note(tmp_path: Path) -> None:
    src = shutil.copytree(LLAMA, tmp_path / "src")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.input_scale"] = torch.tensor([0.5])
    t["model.layers.1.mlp.down_proj.input_scale"] = torch.tensor([0.25])
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    result = convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    dropped = [n for n in result.notes if "activation-only" in n]
    assert dropped == [
        "dropped 2 activation-only scale(s) (model.layers.0.self_attn.q_proj.input_scale, "
        "model.layers.1.mlp.down_proj.input_scale): they scale activations, not weights"
    ]


def test_modules_to_not_convert_are_read_as_they_are(tmp_path: Path) -> None:
    src = shutil.copytree(LLAMA, tmp_path / "src")
    _edit_config(src, modules_to_not_convert=["lm_head", "model.layers.0.mlp.down_proj"])
    with pytest.raises(CkptkitError, match=r"modules_to_not_convert lists model.layers.0.mlp.down_proj.weight"):
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    _edit_config(src, modules_to_not_convert=["lm_head"])
    convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert torch.equal(
        tensors(tmp_path / "out")["lm_head.weight"], load_file(LLAMA / "model.safetensors")["lm_head.weight"]
    )


def _edit_config(folder: Path, **changes: object) -> None:
    doc = json.loads((folder / "config.json").read_text())
    doc["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(doc))


def _with_tensors(folder: Path, **tensors: torch.Tensor | None) -> None:
    t = load_file(folder / "model.safetensors")
    for name, value in tensors.items():
        key = name.replace("__", ".")
        if value is None:
            del t[key]
        else:
            t[key] = value
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})


def _scale(**change: object) -> torch.Tensor:
    s = load_file(LLAMA / "model.safetensors")[SCALE].clone()
    if "value" in change:
        s[1, 0] = change["value"]  # type: ignore[assignment]
    return s


E8M0_NAN = torch.full((2, 2), 0xFF, dtype=torch.uint8).view(torch.float8_e8m0fnu)
BROKEN = {
    "no scale": ({SCALE: None}, {}, rf"{WEIGHT} is quantized \(float8_e4m3fn\) but has no scale {SCALE}"),
    "scale shape": (
        {SCALE: torch.ones(2, 2)},
        {},
        rf"{SCALE} is \[2, 2\], but {WEIGHT} \[40, 56\] in \[20, 20\] blocks",
    ),
    "scale dtype": ({SCALE: _scale().bfloat16()}, {}, rf"{SCALE} is bfloat16; block-FP8 scales"),
    "nan scale": ({SCALE: _scale(value=float("nan"))}, {}, rf"{SCALE}: 1 scale\(s\) are NaN or infinite"),
    "inf scale": ({SCALE: _scale(value=float("inf"))}, {}, rf"{SCALE}: 1 scale\(s\) are NaN or infinite"),
    "unknown method": ({}, {"quant_method": "awq"}, r"quant_method 'awq', which ckptkit does not read"),
    "block lies": (
        {},
        {"weight_block_size": [16, 16]},
        rf"{SCALE} is \[2, 3\], but {WEIGHT} \[40, 56\] in \[16, 16\] blocks needs \[3, 4\]",
    ),
    "ue8m0 lies": ({}, {"scale_fmt": "ue8m0"}, r"scales that are not powers of two, but quantization_config says"),
    "scale alone": (
        {"model.norm.weight_scale_inv": torch.ones(1, 1)},
        {},
        r"model.norm.weight is bfloat16 but has a scale model.norm.weight_scale_inv",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_sources_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    changes, config, message = BROKEN[case]
    src = shutil.copytree(LLAMA, tmp_path / "src")
    if changes:
        _with_tensors(src, **{k.replace(".", "__"): v for k, v in changes.items()})
    if config:
        _edit_config(src, **config)
    with pytest.raises(CkptkitError, match=message) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_e8m0_nan_code_is_refused(tmp_path: Path) -> None:
    """UE8M0 scales stored as F8_E8M0 (DeepSeek V4): 0xFF is NaN."""
    src = shutil.copytree(LLAMA, tmp_path / "src")
    _edit_config(src, scale_fmt="ue8m0")
    e8m0 = {}
    for name, s in load_file(LLAMA / "model.safetensors").items():
        if name.endswith("_scale_inv"):
            e8m0[name.replace(".", "__")] = torch.exp2(torch.log2(s).round()).to(torch.float8_e8m0fnu)
    _with_tensors(src, **e8m0)
    convert(src, tmp_path / "ok", ConvertOptions("hf", dtype="bfloat16"))
    assert verify_paths(src, tmp_path / "ok").verdict().startswith("DEQUANTIZED")
    bad = load_file(src / "model.safetensors")[SCALE].clone()
    bad.view(torch.uint8)[0, 1] = 0xFF
    _with_tensors(src, **{SCALE.replace(".", "__"): bad})
    with pytest.raises(CkptkitError, match=rf"{SCALE}: 1 scale\(s\) are the e8m0 NaN code 0xFF"):
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="bfloat16"))
    assert not (tmp_path / "out").exists()


def test_dtype_fp8_names_the_targets_that_take_it(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match=r"^--dtype fp8 applies only to --to hf or hf-bin or internal or dcp"):
        convert(LLAMA, tmp_path / "m", ConvertOptions("meta", dtype="fp8"))
    assert not (tmp_path / "m").exists()


def test_dtype_fp8_into_a_restored_sharded_layout_indexes_the_scales(tmp_path: Path) -> None:
    """The recorded index no longer fits (scales added): it is written afresh; --verify
    accepts what --dtype fp8 quantized."""
    src = FIXTURES / "hf" / "qwen3"
    result = convert(src, tmp_path / "fp8", ConvertOptions("hf", dtype="fp8", verify=True))
    assert result.plan.restored
    weight_map = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {k: f.name for f in sorted((tmp_path / "fp8").glob("*.safetensors")) for k in load_file(f)}
    assert weight_map == stored
    assert "model.layers.2.mlp.down_proj.weight_scale_inv" in stored


@pytest.mark.parametrize("fixture", ["qwen3_moe-stacked", "phi3"])
def test_dtype_fp8_into_fused_or_stacked_weights_is_one_line(fixture: str, tmp_path: Path) -> None:
    """Stacked experts and phi3's fused qkv_proj: one block scale cannot stand for the weights
    one tensor holds (the scale written was the first part's, and the output did not read back):
    one line, nothing written; stacked experts go per expert when asked."""
    with pytest.raises(CkptkitError, match=r"--dtype fp8: --to hf stores .* as several weights in one tensor"):
        convert(FIXTURES / "hf" / fixture, tmp_path / "out", ConvertOptions("hf", dtype="fp8"))
    assert not (tmp_path / "out").exists()
    if fixture == "qwen3_moe-stacked":
        convert(FIXTURES / "hf" / fixture, tmp_path / "per", ConvertOptions("hf", dtype="fp8", experts="per-expert"))
        read = inspect_path(tmp_path / "per")  # reads back: each expert's weight with its own scale
        assert read["quantization"]["quantized_tensors"] == 39
