"""A block-FP8 source to GGUF equals what llama.cpp's converter writes from the same FP8
folder (it dequantizes ``weight_scale_inv`` itself, cropping edge blocks): key/value
metadata and every tensor, byte for byte (``test_gguf.assert_same_gguf``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_gguf import assert_same_gguf, llama_cpp_ggufs

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

# the fixtures' tiny byte-level BPE tokenizers, named to both converters (see test_gguf.TINY_BPE)
SOURCES = {"qwen3": "qwen2", "llama-overhang": "llama-bpe"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_fp8_source_to_gguf_equals_llama_cpp(name: str, llama_cpp: Path, tmp_path: Path) -> None:
    src = FIXTURES / "fp8" / name
    pre = SOURCES[name]
    outtypes = {"bfloat16": "bf16", "float32": "f32"}
    theirs = llama_cpp_ggufs(llama_cpp, src, {t: tmp_path / f"theirs-{t}.gguf" for t in outtypes.values()}, pre)
    for dtype, outtype in outtypes.items():
        convert(src, tmp_path / f"{dtype}.gguf", ConvertOptions("gguf", dtype=dtype, gguf_pre=pre))
        assert_same_gguf(tmp_path / f"{dtype}.gguf", theirs[outtype])
