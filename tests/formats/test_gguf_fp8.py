"""Scaled FP8 / int8 sources to GGUF equal what llama.cpp's converter writes from the same
folder (it dequantizes them itself: ``dequant_simple``, the stored element widened to float32
times the float32 scale of its block, cropped at the edges, then its own cast to the outtype):
key/value metadata and every tensor, byte for byte (``test_gguf.assert_same_gguf``).

Sources: block FP8 (``weight_scale_inv``: ``fixtures/fp8``); compressed-tensors FP8 per
channel and per 16x16 block (one group of ``fixtures/ct/fp8`` each, below: the converter
takes one config group and no activation scales) and int8 per channel (``fixtures/ct/int8``);
modelopt FP8 per tensor (``fixtures/modelopt/fp8``). The converter refuses the whole
``fixtures/ct/fp8`` (three groups, a per-tensor one, ``input_scale`` / ``k_scale``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf import assert_same_gguf, llama_cpp_ggufs

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

# the fixtures' tiny byte-level BPE tokenizers, named to both converters (see test_gguf.TINY_BPE)
SOURCES = {"fp8/qwen3": "qwen2", "fp8/llama-overhang": "llama-bpe", "ct/int8": "llama-bpe", "modelopt/fp8": "llama-bpe"}
CT_GROUPS = {"ct-fp8-channel": "group_0", "ct-fp8-block": "group_1"}
OUTTYPES: dict[str | None, str] = {"bfloat16": "bf16", "float32": "f32"}
# and the others, for one source: q8_0 quantizes the float32 product (no bf16 rounding first)
OTHER_OUTTYPES: dict[str | None, str] = {"float16": "f16", "q8_0": "q8_0", None: "auto"}


def one_group(group: str, out: Path) -> Path:
    """``fixtures/ct/fp8`` with only ``group``'s weights stored quantized (the others stored as
    bf16: their FP8 widened times their scale), without activation scales or a kv-cache scheme."""
    src = FIXTURES / "ct" / "fp8"
    config = json.loads((src / "config.json").read_text())
    q = config["quantization_config"]
    targets = [t.removeprefix("re:") for t in q["config_groups"][group]["targets"]]
    q.update(config_groups={group: q["config_groups"][group]}, kv_cache_scheme=None)
    stored = load_file(src / "model.safetensors")
    kept: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith(("input_scale", "k_scale", "v_scale", ".weight_scale")):
            continue
        if t.dtype != torch.float8_e4m3fn or any(re.match(p, name.removesuffix(".weight")) for p in targets):
            kept[name] = t
            if t.dtype == torch.float8_e4m3fn:
                kept[name + "_scale"] = stored[name + "_scale"]
            continue
        scale = stored[name + "_scale"].float()
        if scale.dim() == 2:  # blocks (or channels) expanded over the matrix, cropped
            rows, cols = -(-t.shape[0] // scale.shape[0]), -(-t.shape[1] // scale.shape[1])
            scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: t.shape[0], : t.shape[1]]
        kept[name] = (t.float() * scale).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


@pytest.fixture(scope="module")
def ct_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: one_group(g, tmp_path_factory.mktemp(name, numbered=False)) for name, g in CT_GROUPS.items()}


def _same_as_llama_cpp(
    llama_cpp: Path, src: Path, pre: str, tmp_path: Path, outtypes: dict[str | None, str] | None = None
) -> None:
    outtypes = outtypes or dict(OUTTYPES)
    theirs = llama_cpp_ggufs(llama_cpp, src, {t: tmp_path / f"theirs-{t}.gguf" for t in outtypes.values()}, pre)
    for dtype, outtype in outtypes.items():
        convert(src, tmp_path / f"{dtype}.gguf", ConvertOptions("gguf", dtype=dtype, gguf_pre=pre))
        assert_same_gguf(tmp_path / f"{dtype}.gguf", theirs[outtype])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_scaled_source_to_gguf_equals_llama_cpp(name: str, llama_cpp: Path, tmp_path: Path) -> None:
    _same_as_llama_cpp(llama_cpp, FIXTURES / name, SOURCES[name], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CT_GROUPS))
def test_compressed_tensors_fp8_group_to_gguf_equals_llama_cpp(
    name: str, ct_sources: dict[str, Path], llama_cpp: Path, tmp_path: Path
) -> None:
    _same_as_llama_cpp(llama_cpp, ct_sources[name], "llama-bpe", tmp_path)


@pytest.mark.slow
def test_block_fp8_to_every_other_outtype_equals_llama_cpp(llama_cpp: Path, tmp_path: Path) -> None:
    _same_as_llama_cpp(llama_cpp, FIXTURES / "fp8/llama-overhang", "llama-bpe", tmp_path, OTHER_OUTTYPES)
