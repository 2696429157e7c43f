"""The hybrid Qwen stacks (Qwen3-Next, Qwen3.5 dense and MoE) read back from llama.cpp's GGUF:
what :mod:`.hybrid` does on writing, undone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptkit.formats.gguf.made import Made, Reader
    from ckptkit.models.gguf_spec import GGUFSpec

HYBRID_READERS: dict[str, Callable[[dict[str, Any], str, dict[str, Any], set[str]], None]] = {}


def made(
    reader: Reader, tmap: Any, name: str, shape: tuple[int, ...], config: dict[str, Any], spec: GGUFSpec, layers: int
) -> Made | None:
    """The HF tensor ``name`` of a hybrid stack from the GGUF tensors it was written as."""
    return None
