"""Metadata of one stored tensor: what inspect lists and what writers lay out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ckptkit.dtypes import itemsize


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype of a tensor, and the file that holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)
