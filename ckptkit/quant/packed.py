"""compressed-tensors ``pack-quantized`` weights (W4A16 releases): int4 values in groups of
``group_size`` columns (or one group a row), each group times its ``weight_scale``, less its
zero point where the scheme is asymmetric.

A weight ``X.weight`` is stored as ``X.weight_packed``, int32 [rows, cols / 8]: value ``i``
of a row in bits ``4 (i mod 8)`` of word ``i // 8``, plus 8 (so unsigned); ``X.weight_shape``
holds [rows, cols]; ``X.weight_scale`` is [rows, groups]; an asymmetric scheme's
``X.weight_zero_point`` int32 [ceil(rows / 8), groups] packs its int4 zero points the same
way down the rows. Dequantized as compressed-tensors' ``PackedQuantizationCompressor``
does: (value - zero point) x scale, computed in the scale's dtype, which for a bf16 / f16 /
f32 scale is one rounding of the exact float32 product: widened to float32, one cast.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.quant.compressed import PACKED_DTYPE, CompressedTensors, Scheme
from ckptkit.quant.grid import CHUNK_ELEMENTS, SCALE_SUFFIX
from ckptkit.quant.method import Stored

if TYPE_CHECKING:
    import torch

PER_WORD = 8  # int4 values in one int32
OFFSET = 8
PACKED_SUFFIX = "_packed"
SHAPE_SUFFIX = "_shape"
ZERO_SUFFIX = "_zero_point"
SHAPE_DTYPES = ("int64", "int32")


def unpacked(words: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The int4 values (int32, -8..7) of packed ``words`` along ``dim``, 8 a word."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = words.to(torch.int32) if dim == 1 else words.to(torch.int32).t()
    nibbles = (w.unsqueeze(-1) >> shifts) & 0xF
    out = nibbles.reshape(w.shape[0], -1) - OFFSET
    return out if dim == 1 else out.t()


def packed(values: torch.Tensor) -> torch.Tensor:
    """int4 ``values`` (-8..7) packed 8 to an int32 along the rows (columns padded to a word)."""
    import torch

    rows, cols = values.shape
    v = (values.to(torch.int64) + OFFSET) & 0xF
    v = torch.nn.functional.pad(v, (0, -cols % PER_WORD)).reshape(rows, -1, PER_WORD)
    words = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the unsigned word's int32 bits


class PackedCompressedTensors(CompressedTensors):
    """compressed-tensors with ``format: "pack-quantized"`` int4 weights."""

    def __init__(self, config: Any, where: Path) -> None:
        super().__init__(config, where)
        for s in self.schemes:
            if s.stored != PACKED_DTYPE or s.strategy not in ("group", "channel"):
                raise CkptkitError(
                    f"{where}: compressed-tensors pack-quantized with {s.describe()}: ckptkit reads "
                    "pack-quantized int4 weights in groups or channels, not mixed with other formats"
                )
        self._shapes: dict[str, list[int]] = {}  # weight_shape tensor -> the shape its packed weight holds

    def _scheme(self, weight: str) -> Scheme:
        return self.scheme_named(weight)

    def stored_name(self, weight: str) -> str:
        return weight + PACKED_SUFFIX

    def model_name(self, stored: str) -> str | None:
        return stored.removesuffix(PACKED_SUFFIX) if stored.endswith(".weight" + PACKED_SUFFIX) else None

    def scale_names(self, weight: str) -> tuple[str, ...]:
        zero = () if self._scheme(weight).symmetric else (weight + ZERO_SUFFIX,)
        return weight + SCALE_SUFFIX, weight + SHAPE_SUFFIX, *zero

    def weight_of_scale(self, name: str) -> str | None:
        for suffix in (SCALE_SUFFIX, SHAPE_SUFFIX, ZERO_SUFFIX):
            if name.endswith(".weight" + suffix):
                return name.removesuffix(suffix)
        return None

    def model_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * PER_WORD)

    def dequantized_as(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        return name, self.model_shape(shape)

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = f"{self.where.parent / (scale.file or '')}: {scale.name}"
        if len(weight.shape) != 2:
            raise CkptkitError(f"{where}: {weight.name} is {list(weight.shape)}; packed weights are matrices")
        rows, cols = weight.shape[0], weight.shape[1] * PER_WORD
        scheme = self.scheme_of(weight)
        group = cols if scheme.strategy == "channel" else scheme.block[1]
        if cols % group:
            raise CkptkitError(f"{where}: {weight.name} holds {cols} columns, not whole groups of {group}; not read")
        if scale.name.endswith(SHAPE_SUFFIX):
            if scale.dtype not in SHAPE_DTYPES or tuple(scale.shape) != (2,):
                raise CkptkitError(f"{where} is {scale.dtype} {list(scale.shape)}; a weight_shape is two integers")
            self._shapes[scale.name] = [rows, cols]
            return
        want = (rows, cols // group)
        dtypes: tuple[str, ...]
        if scale.name.endswith(ZERO_SUFFIX):
            want, dtypes = (math.ceil(rows / PER_WORD), cols // group), (PACKED_DTYPE,)
        else:
            dtypes = self.scale_dtypes
        if scale.dtype not in dtypes:
            raise CkptkitError(
                f"{where} is {scale.dtype}; pack-quantized {scale.name.rsplit('_', 1)[-1]}s are {' or '.join(dtypes)}"
            )
        if tuple(scale.shape) != want:
            raise CkptkitError(
                f"{where} is {list(scale.shape)}, but {weight.name} {list(weight.shape)} "
                f"({rows} x {cols} int4, groups of {group}) needs {list(want)}"
            )

    def check_scale_values(self, scale: torch.Tensor, name: str) -> None:
        tensor = name.rsplit(": ", 1)[-1]
        if tensor.endswith(ZERO_SUFFIX):
            return  # every nibble is a zero point
        if tensor.endswith(SHAPE_SUFFIX):
            want = self._shapes.get(tensor)
            got = [int(x) for x in scale.reshape(-1).tolist()]
            if want is not None and got != want:
                raise CkptkitError(f"{name} is {got}, but the packed weight holds {want}")
            return
        super().check_scale_values(scale, name)

    def combined(self, scales: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[2, rows, groups] float32: each group's scale, and its zero point (0: symmetric)."""
        import torch

        s = scales[0].to(torch.float32)
        zero = unpacked(scales[2], dim=0)[: s.shape[0]].float() if len(scales) > 2 else torch.zeros_like(s)
        return torch.stack([s, zero])

    def _parts(self, rows: int, cols: int) -> range:
        return range(0, rows, max(1, CHUNK_ELEMENTS // max(cols, 1)))

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] in ``dtype``: (value - zero point) x the group's scale, one cast."""
        import torch

        rows, cols = weight.shape[0], weight.shape[1] * PER_WORD
        group = cols // scale.shape[-1]
        out = torch.empty(rows, cols, dtype=dtype)
        step = self._parts(rows, cols).step
        for r in self._parts(rows, cols):
            s, z = (p[r : r + step].repeat_interleave(group, 1) for p in scale)
            out[r : r + step] = ((unpacked(weight[r : r + step]).float() - z) * s).to(dtype)
        return out

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The packed words whose :meth:`dequantize` with ``scale`` is ``values``."""
        import torch

        rows, cols = values.shape
        group = cols // scale.shape[-1]
        out = torch.empty(rows, math.ceil(cols / PER_WORD), dtype=torch.int32)
        step = self._parts(rows, cols).step
        for r in self._parts(rows, cols):
            s, z = (p[r : r + step].repeat_interleave(group, 1) for p in scale)
            q = (values[r : r + step].float() / s).round() + z
            out[r : r + step] = packed(q.clamp(-OFFSET, OFFSET - 1))
        return out

    def block_rows(self) -> int:
        return 1

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["packing"] = "8 int4 a word (value + 8, low bits first)"
        info["zero_points"] = "none" if all(s.symmetric for s in self.schemes) else "int4 (asymmetric)"
        return info


CompressedTensors.packed = PackedCompressedTensors
