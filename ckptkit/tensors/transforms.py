"""Reversible tensor transforms between a format's native layout and the canonical one.

A :class:`Transform` is one kind of relation between one native tensor and the canonical
tensor(s) it holds. ``forward`` goes native -> canonical (reading), ``inverse`` canonical ->
native (writing); both directions live in the same class and tests check each pair
bitwise. Adding a kind (a transpose, say) is one subclass used in a family's layout rules.

:class:`RankShards` is the file-level counterpart: Meta's model-parallel ranks.
Every transform here only moves bytes, so each also maps byte ranges: ``forward_spans`` and
``inverse_spans`` say where the result's bytes lie in the input's (lists of
:class:`~ckptkit.io.Span`, concatenated in order), and a conversion copies
them file to file without reading them into memory (:mod:`ckptkit.io`).
torch is imported inside the methods so that metadata-only work stays torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptkit.io import Span, coalesce, take, take_ranges, take_rows, total_bytes

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from ckptkit.io import Rows

Shape = tuple[int, ...]
Spans = list[Span]


class Transform:
    """One kind of relation between a native tensor and its canonical tensor(s).

    The base class is the identity (the native tensor is the canonical one, same bytes).
    A subclass that overrides ``forward``/``inverse`` but not the span maps gets no span
    map at all (None: its tensors go through memory), never the identity's by mistake.
    """

    name = "copy"
    #: True when the native tensor only repeats a canonical tensor stored elsewhere
    #: (a tied ``lm_head``): reading checks it instead of taking data from it.
    duplicate = False
    #: True when the canonical tensor is the native one with its rows permuted
    #: (:meth:`forward_rows` composes that order with another)
    permutes_rows = False

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

    def forward_spans(self, native: Spans, shape: Shape, cfg: Any, shapes: Sequence[Shape]) -> list[Spans | None]:
        """Where each canonical tensor's bytes lie within the native tensor's ``native``."""
        if not self.is_identity():
            return [None] * len(shapes)
        return [native]

    def inverse_spans(self, parts: Sequence[Spans], shapes: Sequence[Shape], cfg: Any) -> Spans | None:
        """Where the native tensor's bytes lie within the canonical tensors' ``parts``."""
        if not self.is_identity():
            return None
        return parts[0]

    def forward_rows(self, native: Spans, shape: Shape, cfg: Any, rows: Rows) -> Spans | None:
        """Where rows ``rows`` (in that order) of the canonical tensor lie within ``native``,
        for a transform that :attr:`permutes_rows`: the two orders composed before any span
        is made. None from the rest."""
        return None

    def is_identity(self) -> bool:
        """Whether the canonical tensor is the native one, bytes and all."""
        cls = type(self)
        return cls.forward is Transform.forward and cls.inverse is Transform.inverse

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

    permutes_rows = True

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

    def forward_spans(self, native: Spans, shape: Shape, cfg: Any, shapes: Sequence[Shape]) -> list[Spans | None]:
        return [self._rows(native, shape, getattr(cfg, self.heads), to_meta=False)]

    def inverse_spans(self, parts: Sequence[Spans], shapes: Sequence[Shape], cfg: Any) -> Spans:
        return self._rows(parts[0], shapes[0], getattr(cfg, self.heads), to_meta=True)

    def forward_rows(self, native: Spans, shape: Shape, cfg: Any, rows: Rows) -> Spans:
        return self._rows(native, shape, getattr(cfg, self.heads), to_meta=False, then=rows)

    @staticmethod
    def _rows(spans: Spans, shape: Shape, n: int, to_meta: bool, then: Rows | None = None) -> Spans:
        """The row permutation of forward (Meta -> HF) or inverse (HF -> Meta) as row ranges,
        followed by taking rows ``then`` of the result."""
        import numpy as np

        order = rope_rows(shape[0], n, to_meta)
        if then is not None:
            wanted = np.asarray(then, dtype=np.int64)
            if len(wanted) and not 0 <= int(wanted.min()) <= int(wanted.max()) < len(order):
                raise ValueError(f"rows {wanted.min()}..{wanted.max()} outside a tensor of {len(order)} rows")
            order = order[wanted]
        return take_rows(spans, total_bytes(spans) // shape[0], order)


def rope_rows(rows: int, heads: int, to_meta: bool) -> npt.NDArray[np.int64]:
    """:class:`RopePermute`'s row permutation as indices (output row ``i`` is input row
    ``order[i]``): per head of ``hd`` rows, HF's row ``j * hd/2 + i`` is Meta's row ``2 * i + j``.
    Towards Meta (as llama.cpp's converter permutes too) each head's two halves interleave."""
    import numpy as np

    hd = rows // heads
    half = hd // 2
    h = np.arange(heads, dtype=np.int64)[:, None, None] * hd
    if to_meta:  # output row h*hd + 2i + j (axes h, i, j) comes from HF row h*hd + j*half + i
        return (h + np.arange(half)[None, :, None] + half * np.arange(2)[None, None, :]).reshape(-1)
    # output row h*hd + j*half + i (axes h, j, i) comes from Meta row h*hd + 2i + j
    return (h + np.arange(2)[None, :, None] + 2 * np.arange(half)[None, None, :]).reshape(-1)


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

    def forward_spans(self, native: Spans, shape: Shape, cfg: Any, shapes: Sequence[Shape]) -> list[Spans | None]:
        row_bytes = total_bytes(native) // max(shape[0], 1)
        out: list[Spans | None] = []
        start = 0
        for part in shapes:
            out.append(take(native, start, part[0] * row_bytes))
            start += part[0] * row_bytes
        return out

    def inverse_spans(self, parts: Sequence[Spans], shapes: Sequence[Shape], cfg: Any) -> Spans:
        return [span for part in parts for span in part]


class Stacked(Fused):
    """Experts stacked on a new dim 0: native [E, k * R, C] holds, expert by expert, its
    ``k`` canonical [R, C] parts (``gate_up_proj``: gate then up, k = 2; ``down_proj``:
    k = 1). The canonical parts come in that order (expert 0's parts, expert 1's, ...).

    Only bytes move; nothing is ever transposed. The canonical shapes come from the config,
    so a native tensor whose last two dims do not match them is an error even when the
    element count fits (an [E, I, H] ``down_proj`` with H == I cannot be told apart by
    shape, and is taken as the [E, H, I] that transformers writes).
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.name = f"stacked({k})"

    def part_shapes(self, native: Shape, expected: Sequence[Shape | None]) -> list[Shape]:
        if len(native) != 3 or any(e is None for e in expected):
            raise ValueError(f"shape {list(native)}, not the 3-D stack of {len(expected)} expert parts")
        parts = [e for e in expected if e is not None]
        want = self.native_shape(parts)
        if tuple(native) != want or any(p[1:] != parts[0][1:] for p in parts):
            raise ValueError(f"shape {list(native)} but the config implies {list(want)}")
        return parts

    def native_shape(self, parts: Sequence[Shape]) -> Shape:
        n = len(parts) // self.k
        return (n, sum(p[0] for p in parts[: self.k]), *parts[0][1:])

    def forward(self, native: torch.Tensor, cfg: Any, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return super().forward(native.reshape(-1, *native.shape[2:]), cfg, shapes)

    def inverse(self, parts: Sequence[torch.Tensor], cfg: Any) -> torch.Tensor:
        return super().inverse(parts, cfg).reshape(self.native_shape([tuple(p.shape) for p in parts]))

    def forward_spans(self, native: Spans, shape: Shape, cfg: Any, shapes: Sequence[Shape]) -> list[Spans | None]:
        return super().forward_spans(native, (shape[0] * shape[1], *shape[2:]), cfg, shapes)


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

    def forward_spans(self, parts: Sequence[Spans], shard: Shape, dim: int | None) -> Spans:
        """Where the merged tensor's bytes lie in the ranks' shards (``shard``: one shard's shape)."""
        if dim is None:
            return parts[0]
        outer = math.prod(shard[:dim])
        piece = total_bytes(parts[0]) // max(outer, 1)  # one rank's contiguous run per outer index
        runs = [take_ranges(p, [(o * piece, piece) for o in range(outer)]) for p in parts]
        if all(len(r) == outer for r in runs):  # each run one span: interleave them
            return coalesce([runs[r][o] for o in range(outer) for r in range(len(parts))])
        return coalesce([s for o in range(outer) for p in parts for s in take(p, o * piece, piece)])

    def inverse_spans(self, spans: Spans, shape: Shape, n: int, dim: int | None) -> list[Spans]:
        """Where each rank's shard lies in the whole tensor's bytes ``spans``."""
        if dim is None:
            return [spans] * n
        if shape[dim] % n:
            raise ValueError(f"dim {dim} of size {shape[dim]} does not split into {n} ranks")
        outer = math.prod(shape[:dim])
        run = total_bytes(spans) // max(outer, 1)  # the whole tensor's bytes per outer index
        piece = run // n
        return [coalesce(take_ranges(spans, [(o * run + r * piece, piece) for o in range(outer)])) for r in range(n)]

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
STACKED_PAIRS = Stacked(2)
STACKED = Stacked(1)
RANKS = RankShards()
