"""Tensors llama.cpp writes with their rows reordered, blocks of them transposed or + 1 added
(DeepSeek's ``attn_k_b`` / ``attn_v_b``, Qwen3.5's value heads tiled, Gemma's and Qwen's
norms, Qwen3.5's ``-exp(A_log)``) are written from the source's bytes, without torch: the bytes
torch makes of the whole tensor (which the llama.cpp comparisons in the family tests check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckptkit.formats.gguf.writer as writer
from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

CASES = [("deepseek_v3", "llama-bpe"), ("qwen3_5", "qwen2"), ("qwen3_5_moe", "qwen2"), ("gemma", None)]


@pytest.mark.parametrize(("name", "pre"), CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "q8_0"])
def test_moved_rows_stream_from_their_bytes(
    name: str, pre: str | None, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = ConvertOptions("gguf", dtype=dtype, gguf_pre=pre, allow_lossy_cast=True)
    whole = tmp_path / "whole.gguf"
    with monkeypatch.context() as m:  # every tensor made whole by torch
        m.setattr(writer, "row_chunks", lambda *args: None)
        convert(FIXTURES / "hf" / name, whole, opts)
    made: list[tuple[int, ...]] = []
    real = writer.quantized_chunks

    def counted(t: Any, *args: Any) -> Any:
        made.append(tuple(t.shape))
        return real(t, *args)

    monkeypatch.setattr(writer, "quantized_chunks", counted)
    streamed = tmp_path / "streamed.gguf"
    convert(FIXTURES / "hf" / name, streamed, opts)
    assert streamed.read_bytes() == whole.read_bytes()
    if dtype != "q8_0":  # (Q8_0 rows that do not split into blocks are F16: cast by torch)
        assert made == []
