"""Block FP8 (``quant_method: "fp8"``): DeepSeek V3/R1/V3.1, Kimi K2, Qwen "-FP8" releases.

Each quantized linear weight is ``float8_e4m3fn`` with ``<weight>_scale_inv``: one float32
(or, ``scale_fmt: "ue8m0"``, a power of two, possibly stored as ``float8_e8m0fnu``) per
``weight_block_size`` block, *multiplied* despite its name; blocks overhanging the tensor
are cropped. Dequantization is the reference recipe: widen to float32, multiply by the
block's float32 scale, one round-to-nearest-even cast to the output dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.quant import scaled
from ckptkit.quant.method import (
    QuantMethod,
    Stored,
    check_finite_nonnegative,
    e8m0_nans,
    register_method,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy

SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0
ACTIVATION_SCALES = (".input_scale", ".activation_scale", "_activation_scale", ".k_scale", ".v_scale")
SCALE_DTYPES = {"float": ("float32",), "ue8m0": ("float32", "float8_e8m0fnu")}


class BlockFP8(QuantMethod):
    """``quant_method: "fp8"`` with ``weight_block_size`` blocks (e4m3 weights)."""

    name = "fp8"
    stored = "float8_e4m3fn"

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        block = config.get("weight_block_size", [128, 128])
        if not (
            isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
        ):  # fmt: skip
            raise CkptkitError(f"{where}: quantization_config.weight_block_size must be two positive integers")
        self.block: tuple[int, int] = (block[0], block[1])
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CkptkitError(f"{where}: quantization_config.fmt {fmt!r}: ckptkit reads block FP8 in e4m3 only")
        self.scale_fmt = config.get("scale_fmt") or "float"
        if self.scale_fmt not in SCALE_DTYPES:
            raise CkptkitError(f"{where}: quantization_config.scale_fmt {self.scale_fmt!r}: not float or ue8m0")
        skip = config.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise CkptkitError(f"{where}: quantization_config.modules_to_not_convert must be a list of names")
        self.skip = tuple(skip)

    def scale_name(self, weight: str) -> str:
        return weight + SCALE_SUFFIX

    def weight_of_scale(self, name: str) -> str | None:
        return name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else None

    def is_activation_scale(self, name: str) -> bool:
        return name.endswith(ACTIVATION_SCALES)

    def keeps_unquantized(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return any(module == m or module.endswith("." + m) or module.startswith(m + ".") for m in self.skip)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        rows, cols = shape[-2:]
        return (*shape[:-2], math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = self.where.parent / (scale.file or "")
        if len(weight.shape) < 2:
            raise CkptkitError(f"{where}: {weight.name} is {weight.dtype} {list(weight.shape)}: not a block-FP8 matrix")
        want = self.scale_shape(weight.shape)
        if scale.shape != want:
            raise CkptkitError(
                f"{where}: {scale.name} is {list(scale.shape)}, but {weight.name} {list(weight.shape)} in "
                f"{list(self.block)} blocks needs {list(want)}"
            )
        allowed = SCALE_DTYPES[self.scale_fmt]
        if scale.dtype not in allowed:
            raise CkptkitError(
                f"{where}: {scale.name} is {scale.dtype}; block-FP8 scales with scale_fmt {self.scale_fmt!r} "
                f"are {' or '.join(allowed)}"
            )

    def check_scale_array(self, values: np.ndarray, stored: str, name: str) -> None:
        import numpy as np

        if stored == "float8_e8m0fnu":  # 0xFF is the one code read as NaN
            e8m0_nans(int(np.isnan(values).sum()), name)
            return
        check_finite_nonnegative(values, name, "block-FP8 scale tensor")
        if self.scale_fmt == "ue8m0":
            mantissa, _ = np.frexp(values[values != 0])
            if (mantissa != 0.5).any():
                raise CkptkitError(
                    f"{name}: scales that are not powers of two, but quantization_config says scale_fmt 'ue8m0'"
                )

    def block_rows(self) -> int:
        return self.block[0]

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scaled.dequantize(weight, scale, self.block, dtype)

    def loaded_pieces(self, weight: Lazy, scales: tuple[Lazy, ...], dtype: str, lead: int = 0) -> Iterator[memoryview]:
        return scaled.dequantized_pieces(weight, scaled.scale_values(scales), self.block, dtype, lead)

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        import torch

        return scaled.requantize(values, scale, self.block, torch.float8_e4m3fn)

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's and transformers' formula: ``scale_inv = amax / 448`` per block (1 for
        an all-zero block), ``e4m3(values / scale_inv)``, in float32; with ``scale_fmt:
        "ue8m0"`` the scale rounded up to a power of two, as DeepSeek V3.1's recipe does."""
        import torch

        br, bc = self.block
        rows, cols = values.shape[-2:]
        v = values.reshape(-1, rows, cols).float()
        sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
        padded = torch.zeros(v.shape[0], sr * br, sc * bc)
        padded[:, :rows, :cols] = v.abs()
        amax = padded.reshape(v.shape[0], sr, br, sc, bc).amax(dim=(2, 4))
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        if self.scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = scale.reshape(*values.shape[:-2], sr, sc)
        return self.requantize(values, scale), scale

    def describe(self) -> dict[str, Any]:
        scales = "float32" if self.scale_fmt == "float" else "ue8m0 (powers of two)"
        return {"method": self.name, "block": list(self.block), "stored": self.stored, "scales": scales}


register_method(BlockFP8)
