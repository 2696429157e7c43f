"""Reversible tensor transforms applied between a format's layout and the canonical one.

Every function here has an exact inverse next to it; tests check each pair bitwise.
"""

from __future__ import annotations

import torch


def rope_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from Meta's interleaved-pair rope layout to HF's rotate-half one."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`rope_meta_to_hf`."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def split_rows(w: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Split a fused tensor (Phi-3 ``qkv_proj``, ``gate_up_proj``) into its parts on dim 0."""
    if sum(sizes) != w.shape[0]:
        raise ValueError(f"cannot split {w.shape[0]} rows into {sizes}")
    return [p.contiguous() for p in torch.split(w, sizes, dim=0)]


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`split_rows`."""
    return torch.cat(parts, dim=0)


def split_ranks(w: torch.Tensor, n: int, dim: int | None) -> list[torch.Tensor]:
    """Split a tensor into ``n`` model-parallel shards on ``dim`` (None: replicate)."""
    if dim is None:
        return [w] * n
    if w.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {w.shape[dim]} does not split into {n} ranks")
    return [p.contiguous() for p in torch.chunk(w, n, dim=dim)]


def merge_ranks(parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Inverse of :func:`split_ranks` (replicated tensors must be identical)."""
    if dim is None:
        return parts[0]
    return torch.cat(parts, dim=dim)
