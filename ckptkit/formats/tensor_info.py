"""Metadata of one stored tensor: what inspect lists and what writers lay out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptkit.tensors.dtypes import ITEMSIZE


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype name (``"bfloat16"``) of a tensor, and the file that holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]
