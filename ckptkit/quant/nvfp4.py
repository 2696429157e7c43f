"""NVIDIA modelopt NVFP4 releases (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``).

A quantized linear weight is uint8 [rows, cols / 2]: e2m1 values (sign, 2 exponent bits, 1
mantissa bit) packed two per byte, the even column in the low nibble; ``weight_scale`` is
float8 e4m3 [rows, cols / 16], one scale per 16 values of a row, and ``weight_scale_2`` one
float32 for the whole tensor (``input_scale`` scales activations: dropped). Dequantized as
modelopt's ``NVFP4QTensor.dequantize`` does it: the block's scale in float32 is
``e4m3 x weight_scale_2`` (one rounding), each value widened to float32 times it (one
rounding), one round-to-nearest-even cast to the output dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.quant.grid import E4M3, SCALE_SUFFIX
from ckptkit.quant.method import Stored
from ckptkit.quant.modelopt import ModelOptFP8, fields
from ckptkit.quant.mxfp4 import e2m1_packed, e2m1_values
from ckptkit.quant.scaled import CHUNK_ELEMENTS
from ckptkit.tensors.dtypes import to_torch

if TYPE_CHECKING:
    import torch

    from ckptkit.tensors.lazy import Lazy

BLOCK = 16  # values per e4m3 scale: 8 packed bytes
GLOBAL_SUFFIX = "_scale_2"


class ModelOptNVFP4(ModelOptFP8):
    """``quant_algo: "NVFP4"``: e2m1 pairs, e4m3 scales per 16 values, a float32 global scale."""

    stored = "uint8"
    ggml_type = "NVFP4"

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        group = fields(config).get("group_size", BLOCK)
        if group != BLOCK:
            raise CkptkitError(f"{where}: NVFP4 group_size {group!r}: NVFP4 scales blocks of {BLOCK}")

    def scale_names(self, weight: str) -> tuple[str, ...]:
        return weight + SCALE_SUFFIX, weight + GLOBAL_SUFFIX

    def weight_of_scale(self, name: str) -> str | None:
        if name.endswith(".weight" + GLOBAL_SUFFIX):
            return name.removesuffix(GLOBAL_SUFFIX)
        return super().weight_of_scale(name)

    def block_rows(self) -> int:
        return 1

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = self.where.parent / (scale.file or "")
        if scale.name.endswith(GLOBAL_SUFFIX):
            if scale.dtype != "float32" or len(scale.shape) > 1 or sum(scale.shape) > 1:
                raise CkptkitError(
                    f"{where}: {scale.name} is {scale.dtype} {list(scale.shape)}; "
                    "an NVFP4 weight_scale_2 is one float32"
                )
            return
        if len(weight.shape) != 2 or weight.shape[1] % (BLOCK // 2):
            raise CkptkitError(
                f"{where}: {weight.name} is uint8 {list(weight.shape)}: NVFP4 weights are matrices of rows "
                f"of whole {BLOCK}-value blocks ({BLOCK // 2} bytes each)"
            )
        if scale.dtype != E4M3:
            raise CkptkitError(f"{where}: {scale.name} is {scale.dtype}; NVFP4 weight scales are {E4M3}")
        rows, cols = weight.shape[0], weight.shape[1] * 2
        want = (rows, cols // BLOCK)
        if tuple(scale.shape) != want:
            raise CkptkitError(
                f"{where}: {scale.name} is {list(scale.shape)}, but {weight.name} uint8 {list(weight.shape)} "
                f"({rows} x {cols} values) needs {list(want)}, one scale per {BLOCK} values"
            )

    def check_scale_values(self, scale: torch.Tensor, name: str) -> None:
        super().check_scale_values(scale.float(), name)

    def combined(self, scales: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Each block's float32 scale: ``weight_scale x weight_scale_2`` (modelopt's ``per_block_scale``)."""
        import torch

        return scales[0].to(torch.float32) * scales[1].to(torch.float32).reshape(())

    def model_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * 2)

    def dequantized_as(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        return name, self.model_shape(shape)

    def _rows(self, rows: int, cols: int) -> range:
        return range(0, rows, max(1, CHUNK_ELEMENTS // max(cols, 1)))

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] in ``dtype``: e2m1 value x the block's float32 scale, one cast."""
        import torch

        rows, cols = weight.shape[0], weight.shape[1] * 2
        out = torch.empty(rows, cols, dtype=dtype)
        step = self._rows(rows, cols).step
        for r in self._rows(rows, cols):
            part = e2m1_values(weight[r : r + step]).reshape(-1, cols // BLOCK, BLOCK)
            out[r : r + step] = part.mul_(scale[r : r + step].unsqueeze(-1)).reshape(-1, cols).to(dtype)
        return out

    def loaded_pieces(
        self, weight: Lazy, scales: tuple[Lazy, ...], dtype: str, lead: int = 0
    ) -> Iterator[torch.Tensor]:
        """:meth:`dequantize` a few MiB of rows at a time, never the whole result at once."""
        scale, codes, dtype_ = self.scale_of(scales), weight.get(), to_torch(dtype)
        rows, cols = codes.shape[0], codes.shape[1] * 2
        step = self._rows(rows, cols).step
        for r in self._rows(rows, cols):
            yield self.dequantize(codes[r : r + step], scale[r : r + step], dtype_).reshape(-1)

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The packed codes whose :meth:`dequantize` with ``scale`` is ``values``: each value
        over its block's scale, to the nearest e2m1 code (a tie: the even code)."""
        import torch

        rows, cols = values.shape
        out = torch.empty(rows, cols // 2, dtype=torch.uint8)
        step = self._rows(rows, cols).step
        for r in self._rows(rows, cols):
            part = values[r : r + step].to(torch.float32).reshape(-1, cols // BLOCK, BLOCK)
            out[r : r + step] = e2m1_packed((part / scale[r : r + step].unsqueeze(-1)).reshape(-1, cols))
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "block": [1, BLOCK],
            "stored": "uint8 (e2m1 pairs)",
            "scales": "float8_e4m3fn per 16 x float32 weight_scale_2",
        }


ModelOptFP8.variants["NVFP4"] = ModelOptNVFP4
