"""Reversible tensor transforms between a format's native layout and the canonical one.

A :class:`Transform` is one kind of relation between one native tensor and the canonical
tensor(s) it holds. ``forward`` goes native -> canonical (reading), ``inverse`` canonical ->
native (writing); both directions live in the same class and tests check each pair
bitwise. Adding a kind (a transpose, say) is one subclass used in a family's layout rules.

:class:`RankShards` is the file-level counterpart: Meta's model-parallel ranks.
torch is imported inside the methods so that metadata-only work stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]


class Transform:
    """Identity: the native tensor is the canonical one (same bytes)."""

    name = "copy"
    #: True when the native tensor only repeats a canonical tensor stored elsewhere
    #: (a tied ``lm_head``): reading checks it instead of taking data from it.
    duplicate = False

    def part_shapes(self, native: Shape, expected: Sequence[Shape | None]) -> list[Shape]:
        """The canonical tensors' shapes given the native one (ValueError when they cannot fit)."""
        return [native]

    def native_shape(self, parts: Sequence[Shape]) -> Shape:
        return parts[0]

    def forward(self, native: torch.Tensor, cfg: Any, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        """Native tensor -> canonical tensor(s)."""
        return [native]

    def inverse(self, parts: Sequence[torch.Tensor], cfg: Any) -> torch.Tensor:
        """Canonical tensor(s) -> native tensor."""
        return parts[0]

    def __repr__(self) -> str:
        return self.name


class Tied(Transform):
    """A native copy of a canonical tensor that the canonical model stores once."""

    name = "tied"
    duplicate = True


class RopePermute(Transform):
    """Meta's interleaved-pair rope rows <-> HF's rotate-half rows, per head.

    ``heads`` names the config field holding the head count (``num_heads`` for q,
    ``num_kv_heads`` for k).
    """

    def __init__(self, heads: str) -> None:
        self.heads = heads
        self.name = f"rope({heads})"

    def forward(self, native: torch.Tensor, cfg: Any, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        n = getattr(cfg, self.heads)
        hd = native.shape[0] // n
        return [native.reshape(n, hd // 2, 2, *native.shape[1:]).transpose(1, 2).reshape(native.shape)]

    def inverse(self, parts: Sequence[torch.Tensor], cfg: Any) -> torch.Tensor:
        w, n = parts[0], getattr(cfg, self.heads)
        hd = w.shape[0] // n
        return w.reshape(n, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Fused(Transform):
    """Canonical parts stacked on dim 0 (Phi-3 ``qkv_proj``, ``gate_up_proj``)."""

    name = "fused"

    def part_shapes(self, native: Shape, expected: Sequence[Shape | None]) -> list[Shape]:
        sizes = [e[0] if e else 0 for e in expected]
        if sum(sizes) != native[0]:
            raise ValueError(f"{native[0]} rows but the config implies {' + '.join(map(str, sizes))}")
        return [(s, *native[1:]) for s in sizes]

    def native_shape(self, parts: Sequence[Shape]) -> Shape:
        return (sum(p[0] for p in parts), *parts[0][1:])

    def forward(self, native: torch.Tensor, cfg: Any, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        sizes = [s[0] for s in shapes]
        if sum(sizes) != native.shape[0]:
            raise ValueError(f"cannot split {native.shape[0]} rows into {sizes}")
        return [p.contiguous() for p in native.split(sizes, dim=0)]

    def inverse(self, parts: Sequence[torch.Tensor], cfg: Any) -> torch.Tensor:
        import torch

        return torch.cat(list(parts), dim=0)


class RankShards:
    """Model-parallel ranks: ``forward`` merges rank shards, ``inverse`` splits a tensor
    into ``n`` shards on ``dim`` (None: every rank holds the whole, identical tensor)."""

    def forward(self, parts: Sequence[torch.Tensor], dim: int | None) -> torch.Tensor:
        if dim is None:
            return parts[0]
        import torch

        return torch.cat(list(parts), dim=dim)

    def inverse(self, w: torch.Tensor, n: int, dim: int | None) -> list[torch.Tensor]:
        if dim is None:
            return [w] * n
        if w.shape[dim] % n:
            raise ValueError(f"dim {dim} of size {w.shape[dim]} does not split into {n} ranks")
        return [p.contiguous() for p in w.chunk(n, dim=dim)]

    @staticmethod
    def shard_shape(shape: Shape, n: int, dim: int | None) -> Shape:
        if n == 1 or dim is None:
            return shape
        return tuple(s // n if i == dim else s for i, s in enumerate(shape))


COPY = Transform()
TIED = Tied()
ROPE_Q = RopePermute("num_heads")
ROPE_K = RopePermute("num_kv_heads")
FUSED = Fused()
RANKS = RankShards()
