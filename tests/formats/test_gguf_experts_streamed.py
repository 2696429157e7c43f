"""Merged expert tensors are written to GGUF a chunk at a time from the source's bytes (the
whole [E, ...] stack never built in memory) where their experts are stored as they are, and
those bytes equal the stack built in memory (which llama.cpp's converter tests compare)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptkit.formats.gguf.experts as experts
import ckptkit.formats.gguf.tensors as gguf_tensors
from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

# per-expert tensors (DeepSeek V3, Mixtral, GLM-4 MoE), transformers' stacked ones read per expert
# (Mixtral), and Qwen 3.5's packed gate_up_proj split into its gate and up halves
CASES = [
    ("deepseek_v3", "llama-bpe"),
    ("mixtral", None),
    ("mixtral-stacked", None),
    ("glm4_moe", "glm4"),
    ("qwen3_5_moe", "qwen2"),
]


@pytest.mark.parametrize(("name", "pre"), CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_experts_stream_from_their_bytes(
    name: str, pre: str | None, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = ConvertOptions("gguf", dtype=dtype, gguf_pre=pre)
    in_memory = tmp_path / "in_memory.gguf"
    with monkeypatch.context() as m:  # every merged tensor built whole by torch, as before
        m.setattr(gguf_tensors, "source_of", lambda make: None)
        convert(FIXTURES / "hf" / name, in_memory, opts)

    def whole(*args: object) -> None:
        raise AssertionError("a merged expert tensor was built whole in memory")

    built = []
    monkeypatch.setattr(experts, "stack", whole)
    monkeypatch.setattr(experts.MergedMaker, "__call__", lambda self: built.append(self) or self.make())
    streamed = tmp_path / "streamed.gguf"
    convert(FIXTURES / "hf" / name, streamed, opts)
    assert built == []
    assert streamed.read_bytes() == in_memory.read_bytes()
