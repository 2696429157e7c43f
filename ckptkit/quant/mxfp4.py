"""MXFP4 (``quant_method: "mxfp4"``): gpt-oss's experts as OpenAI releases them.

A quantized weight ``<name>_blocks`` is uint8 [..., rows, cols / 32, 16]: per output row,
blocks of 32 e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
packed two per byte, the even column in the low nibble; ``<name>_scales`` uint8 [..., rows,
cols / 32] is each block's e8m0 power of two (``2 ** (s - 127)``; 0xFF is NaN). Dequantized
as the reference recipe does: each value widened to float32, multiplied by its block's scale,
one round-to-nearest-even cast to the output dtype; [..., rows, cols] (gpt-oss's layouts
transpose that where they hold the experts as [E, cols, rows]).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.quant.method import QuantMethod, Stored, check_e8m0_codes, register_method
from ckptkit.tensors.dtypes import to_torch

if TYPE_CHECKING:
    import torch

    from ckptkit.tensors.lazy import Lazy

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2n] of uint8 [..., n] e2m1 pairs: the even element in the low nibble
    (bit 3 the sign), as OpenAI's and NVIDIA's releases pack them (one lookup of each byte's pair)."""
    import numpy as np
    import torch

    signed = [*E2M1, *(-v for v in E2M1)]
    pairs = np.array([[signed[b & 0x0F], signed[b >> 4]] for b in range(256)], dtype=np.float32)
    return torch.from_numpy(np.take(pairs, packed.numpy(), axis=0)).flatten(-2)


def e2m1_packed(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] pairs of the e2m1 codes nearest ``scaled`` [..., n] (a tie: the
    even code; beyond +-6: +-6; the sign bit as ``signbit``), packed as :func:`e2m1_values` reads them."""
    import torch

    grid = torch.tensor(E2M1)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = scaled.abs().clamp(max=E2M1[-1])
    low, high = torch.bucketize(mag, mids, right=False), torch.bucketize(mag, mids, right=True)
    codes = torch.where(low % 2 == 0, low, high) | (torch.signbit(scaled).long() << 3)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


class MXFP4(QuantMethod):
    """``quant_method: "mxfp4"``: e2m1 values in blocks of 32 along the columns, e8m0 scales."""

    name = "mxfp4"
    stored = "uint8"
    ggml_type = "MXFP4"

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        skip = config.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise CkptkitError(f"{where}: quantization_config.modules_to_not_convert must be a list of names")
        self.skip = tuple(skip)

    def scale_name(self, weight: str) -> str:
        return weight.removesuffix(BLOCKS) + SCALES

    def weight_of_scale(self, name: str) -> str | None:
        return name.removesuffix(SCALES) + BLOCKS if name.endswith(SCALES) else None

    def is_activation_scale(self, name: str) -> bool:
        return False

    def keeps_unquantized(self, name: str) -> bool:
        """Whether a pattern of ``modules_to_not_convert`` (``*`` as in the release's
        ``model.layers.*.self_attn``) names ``name``'s module or one above it."""
        parts = name.removesuffix(BLOCKS).split(".")
        modules = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(m, p) for p in self.skip for m in modules)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:-1]

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = self.where.parent / (scale.file or "")
        if len(weight.shape) < 3 or weight.shape[-1] != BLOCK // 2:
            raise CkptkitError(
                f"{where}: {weight.name} is {list(weight.shape)}: MXFP4 blocks are [..., rows, cols / 32, 16]"
            )
        if scale.shape != self.scale_shape(weight.shape) or scale.dtype != "uint8":
            raise CkptkitError(
                f"{where}: {scale.name} is {scale.dtype} {list(scale.shape)}, but {weight.name} "
                f"{list(weight.shape)} needs uint8 (e8m0) scales {list(self.scale_shape(weight.shape))}"
            )

    def check_scale_values(self, scale: torch.Tensor, name: str) -> None:
        check_e8m0_codes(scale.numpy(), name)

    def block_rows(self) -> int:
        return 1

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., rows, cols] in ``dtype``: e2m1 value x ``2 ** (scale - 127)`` in float32, one cast."""
        import torch

        factor = torch.exp2(scale.to(torch.float32) - 127).unsqueeze(-1)
        out = e2m1_values(weight).mul_(factor).to(dtype)
        return out.reshape(*weight.shape[:-2], weight.shape[-2] * BLOCK)

    def dequantized_as(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """``X_blocks`` [E, rows, cols / 32, 16] -> ``X`` [E, cols, rows], as transformers holds it."""
        rows, cols = shape[-3], shape[-2] * BLOCK
        return name.removesuffix(BLOCKS), (*shape[:-3], cols, rows)

    def loaded(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As transformers' ``Mxfp4Config(dequantize=True)`` loader holds it: [E, cols, rows]."""
        return self.dequantize(weight, scale, dtype).transpose(-1, -2).contiguous()

    def loaded_pieces(
        self, weight: Lazy, scales: tuple[Lazy, ...], dtype: str, lead: int = 0
    ) -> Iterator[torch.Tensor]:
        """:meth:`loaded` one expert at a time (its columns are the result's rows: an expert
        is the least that makes whole rows), never every expert's result at once."""
        codes, scale = weight.get(), self.scale_of(scales)
        experts, each = codes.reshape(-1, *codes.shape[-3:]), scale.reshape(-1, *scale.shape[-2:])
        for e in range(experts.shape[0]):
            yield self.loaded(experts[e], each[e], to_torch(dtype)).reshape(-1)

    def unloaded(self, values: torch.Tensor) -> torch.Tensor:
        return values.transpose(-1, -2)

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The blocks whose :meth:`dequantize` with ``scale`` is ``values``: each value over
        its block's scale, to the nearest e2m1 code (a tie: the even code)."""
        import torch

        scaled = values.to(torch.float32).reshape(*scale.shape, BLOCK) / torch.exp2(scale.float() - 127).unsqueeze(-1)
        return e2m1_packed(scaled)

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MX recipe: per block, exponent ``floor(log2(amax)) - 2`` (e2m1's largest), e8m0."""
        import torch

        blocks = values.to(torch.float32).reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=-1)
        exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
        scale = (exponent.clamp(-127, 127) + 127).to(torch.uint8)
        return self.requantize(values, scale), scale

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "block": [1, BLOCK], "stored": "uint8 (e2m1 pairs)", "scales": "e8m0 (uint8)"}


register_method(MXFP4)
