"""One tensor of a GGUF being written: its name, GGML type, and how its values are made
(from the source's bytes where they lie there, blocks of rows moved as :class:`Moved` says)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy


@dataclass(frozen=True)
class Moved:
    """How each block of ``rows`` consecutive source rows is rearranged: viewed as an array of
    ``shape`` elements, its axes put in the order ``axes`` (empty: as they are); with
    ``plus_one``, its values + 1 in float32 (a norm llama.cpp stores as ``1 + w``, as F32); with
    ``neg_exp``, bfloat16 values as ``-exp`` of them in float32 (``A_log``, as F32)."""

    rows: int = 1
    shape: tuple[int, ...] = ()
    axes: tuple[int, ...] = ()
    plus_one: bool = False
    neg_exp: bool = False

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The same rearrangement of a whole tensor, with torch (``plus_one`` and ``neg_exp`` aside)."""
        if not self.axes:
            return t
        blocks = t.reshape(-1, *self.shape).permute(0, *(a + 1 for a in self.axes))
        return blocks.reshape(t.shape[0], -1).reshape(t.shape)


PLUS_ONE = Moved(plus_one=True)
NEG_EXP = Moved(neg_exp=True)


@dataclass
class GGUFTensor:
    """One tensor of the output: its name, llama.cpp's type for it, and how to make it."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    make: Callable[[], torch.Tensor]  # transformed, in the stored dtype (or float32), not yet quantized
    source: Lazy | None = None  # the source tensor (rows reordered), when the rest is at most a Q/K permutation
    heads: int | None = None  # the heads of that permutation
    moved: Moved | None = None  # else how blocks of the source's rows are rearranged (or + 1)
    weights: np.ndarray | None = None  # imatrix weights (experts, columns) of a weighted quantization

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size
