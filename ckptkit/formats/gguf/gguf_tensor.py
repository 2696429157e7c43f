"""One tensor of a GGUF being written: its name, GGML type, and how its values are made."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy


@dataclass
class GGUFTensor:
    """One tensor of the output: its name, llama.cpp's type for it, and how to make it."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    make: Callable[[], torch.Tensor]  # transformed, in the stored dtype (or float32), not yet quantized
    source: Lazy | None = None  # the source tensor, when the transform is at most a Q/K permutation
    heads: int | None = None  # the heads of that permutation
    weights: np.ndarray | None = None  # imatrix weights (experts, columns) of a weighted quantization

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size
