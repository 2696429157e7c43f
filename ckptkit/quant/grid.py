"""Weights scaled on a grid of blocks: each stored element (float8 e4m3 or int8) times the
scale of its block, blocks of ``rows x cols`` elements cropped at the tensor's edge. A
per-tensor scale is one block of the whole matrix, a per-channel scale blocks of one row,
a per-group scale blocks of one row by ``group_size`` columns.

Shared by the methods whose scales multiply a stored element (compressed-tensors'
``float-quantized`` / ``int-quantized``, modelopt FP8, Mistral's ``qscale_weight``).
Dequantization is the reference recipe: widen to float32, multiply by the block's float32
scale, one round-to-nearest-even cast. Where a release computes in the scale's own dtype
(compressed-tensors: bf16 times bf16), the product of a stored element and a bf16 / f16
scale is exact in float32, so that one rounding gives the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError
from ckptkit.quant import scaled
from ckptkit.quant.method import QuantMethod, Stored, check_finite_nonnegative

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy

E4M3 = "float8_e4m3fn"
INT8 = "int8"


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale shape of a matrix of ``shape`` in ``block`` (rows, cols) blocks."""
    rows, cols = shape[-2:]
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


SCALE_SUFFIX = "_scale"


class GridScaled(QuantMethod):
    """A method whose weights are stored elements times one scale per block of a grid.

    Subclasses say each weight's block (:meth:`block_of`); the scale's shape must be the
    grid's (a per-tensor scale may be stored as a scalar or ``[1]``)."""

    scale_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    activation_scales: tuple[str, ...] = ()  # name endings of activation-only tensors (not weights)

    def scale_name(self, weight: str) -> str:
        """``<weight>_scale``, the scale that multiplies (compressed-tensors', modelopt's name)."""
        return weight + SCALE_SUFFIX

    def weight_of_scale(self, name: str) -> str | None:
        return name.removesuffix(SCALE_SUFFIX) if name.endswith(".weight" + SCALE_SUFFIX) else None

    def is_activation_scale(self, name: str) -> bool:
        return name.endswith(self.activation_scales)

    def block_of(self, weight: Stored) -> tuple[int, int]:
        """The (rows, cols) block one scale of ``weight`` covers (the whole matrix: per tensor)."""
        raise NotImplementedError

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError  # depends on the weight's scheme: see check_pair

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = self.where.parent / (scale.file or "")
        if len(weight.shape) != 2:
            raise CkptkitError(
                f"{where}: {weight.name} is {weight.dtype} {list(weight.shape)}: {self.name} weights are matrices"
            )
        if scale.dtype not in self.scale_dtypes:
            raise CkptkitError(
                f"{where}: {scale.name} is {scale.dtype}; {self.name} weight scales are "
                f"{' or '.join(self.scale_dtypes)}"
            )
        block = self.block_of(weight)
        want = scale_grid(weight.shape, block)
        got = tuple(scale.shape)
        if got != want and not (want == (1, 1) and got in ((), (1,))):
            raise CkptkitError(
                f"{where}: {scale.name} is {list(got)}, but {weight.name} {list(weight.shape)} in "
                f"{list(block)} blocks needs {list(want)}"
            )
        self._remember(weight.shape, got, block)

    def _remember(self, shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int]) -> None:
        """The block of weights of ``shape`` with scales of shape ``scale`` (what
        :meth:`dequantize` reads: it is given tensors, not names)."""
        grids: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]] = self.__dict__.setdefault("_grids", {})
        key = (tuple(shape), scale)
        old = grids.setdefault(key, block)
        if _expanded(shape, old) != _expanded(shape, block):
            raise CkptkitError(
                f"{self.where}: two schemes give {list(shape)} weights {list(scale)} scales in "
                f"{list(old)} and {list(block)} blocks; ckptkit cannot tell them apart"
            )

    def _block(self, weight: torch.Tensor | Lazy, scale: torch.Tensor | np.ndarray) -> tuple[int, int]:
        grids: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]] = self.__dict__.get("_grids", {})
        block = grids.get((tuple(weight.shape), tuple(scale.shape)))
        if block is None:  # a weight not checked on read (quantized in memory): per tensor or per block of the grid
            rows, cols = weight.shape
            sr, sc = (1, 1) if len(scale.shape) < 2 else scale.shape
            block = (math.ceil(rows / sr), math.ceil(cols / sc))
        return block

    def check_scale_array(self, values: np.ndarray, stored: str, name: str) -> None:
        check_finite_nonnegative(values, name, f"{self.name} weight scale")

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scaled.dequantize(weight, scale, self._block(weight, scale), dtype)

    def loaded_pieces(
        self, weight: Lazy, scales: tuple[Lazy, ...], dtype: str, lead: int = 0
    ) -> Iterator[torch.Tensor | memoryview]:
        if type(self).dequantize is not GridScaled.dequantize or type(self).loaded is not QuantMethod.loaded:
            return super().loaded_pieces(weight, scales, dtype, lead)  # a subclass's own arithmetic or layout
        scale = scaled.scale_values(scales)
        return scaled.dequantized_pieces(weight, scale, self._block(weight, scale), dtype, lead)

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        import torch

        return scaled.requantize(values, scale, self._block(values, scale), getattr(torch, self.stored))

    def block_rows(self) -> int:
        return 1  # overridden where a method's blocks are known to span rows


def _expanded(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The block as it applies to a matrix of ``shape`` (a block larger than it is the whole)."""
    return min(block[0], shape[-2]), min(block[1], shape[-1])
