"""Shared helper of the per-family GGUF tests: llama.cpp's GGUFs of an HF folder, every
outtype from one converter process, made on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_gguf import OUTTYPES, llama_cpp_ggufs


def llama_cpp_references(
    llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory, pre: str
) -> Callable[[Path, str | None], Path]:
    """A function giving llama.cpp's GGUF of an HF folder for a dtype of ``OUTTYPES`` (every
    outtype of a folder written by one converter run, with pre-tokenizer ``pre``)."""
    made: dict[Path, dict[str, Path]] = {}

    def get(src: Path, dtype: str | None) -> Path:
        if src not in made:
            tmp = tmp_path_factory.mktemp(src.name)
            made[src] = llama_cpp_ggufs(llama_cpp, src, {t: tmp / f"{t}.gguf" for t in OUTTYPES.values()}, pre)
        return made[src][OUTTYPES[dtype]]

    return get
