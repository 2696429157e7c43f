"""DeepSeek's latent attention as llama.cpp's ``deepseek2`` writes it: ``kv_b_proj``
[heads * (nope + v), rank] split per head into the key rows transposed (``attn_k_b``
[heads, rank, nope]) and the value rows (``attn_v_b`` [heads, v, rank]), both taken from the
stored bytes (rows picked, each head's key block transposed as it is copied: :mod:`.rows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf.gguf_tensor import Moved
from ckptkit.formats.gguf.rows import reordered

if TYPE_CHECKING:
    import torch

    from ckptkit.tensors.lazy import Lazy

Part = tuple[str, tuple[int, ...], "Lazy", Moved | None]  # HF name llama.cpp maps, shape, source rows, moved


def kv_b_parts(hf_name: str, lazy: Lazy, hparams: dict[str, Any]) -> list[Part]:
    """``k_b_proj`` and ``v_b_proj`` of the ``kv_b_proj`` tensor ``hf_name``: their shapes,
    source rows (a view of ``lazy``) and how each head's block of them is moved."""
    import numpy as np

    heads, nope, v = hparams["num_key_value_heads"], hparams["qk_nope_head_dim"], hparams["v_head_dim"]
    rank = lazy.shape[-1]
    if lazy.shape[0] != heads * (nope + v):
        raise CkptkitError(f"{hf_name} has {lazy.shape[0]} rows, not num_key_value_heads * (qk_nope + v) heads")
    starts = np.arange(heads)[:, None] * (nope + v)
    k_rows, v_rows = (starts + np.arange(nope)).reshape(-1), (starts + nope + np.arange(v)).reshape(-1)
    k_b, v_b = (hf_name.replace("kv_b_proj", p) for p in ("k_b_proj", "v_b_proj"))
    return [
        (k_b, (heads, rank, nope), reordered(lazy, k_rows), transposed(nope, rank)),
        (v_b, (heads, v, rank), reordered(lazy, v_rows), None),
    ]


def transposed(rows: int, cols: int) -> Moved:
    """Each block of ``rows`` rows of ``cols`` transposed (a head's key rows, as [rank, nope])."""
    return Moved(rows, (rows, cols), (1, 0))


def maker(source: Lazy, moved: Moved | None, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """``source`` moved as ``moved`` says, as ``shape``, with torch (where the writer cannot copy it)."""
    return lambda: (source.get() if moved is None else moved.apply(source.get())).reshape(shape)
