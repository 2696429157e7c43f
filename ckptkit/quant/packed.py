"""compressed-tensors ``pack-quantized`` weights (W4A16 releases, and any width from 1 to 8
bits): ints in groups of ``group_size`` columns (or one group a row), each group times its
``weight_scale``, less its zero point where the scheme is asymmetric.

A weight ``X.weight`` [..., rows, cols] (matrices; stacked experts [E, rows, cols] packed
one matrix at a time) is stored as ``X.weight_packed``, int32 [..., rows, ceil(cols x bits /
32)]: the row's values, each plus ``2 ** (bits - 1)`` (so unsigned), as one little-endian
bit stream, value ``i`` in bits ``i x bits ..`` (a value may straddle two words; the last
word of a row padded with zero bits); ``X.weight_shape`` holds [..., rows, cols] (read
when the checkpoint is opened where the scales do not say: per channel, a row's words hold
any of several column counts);
``X.weight_scale`` is [..., rows, groups]; an asymmetric scheme's ``X.weight_zero_point``
int32 [..., ceil(rows x bits / 32), groups] packs its zero points the same way down the rows.
Dequantized as compressed-tensors' ``PackedQuantizationCompressor`` does: (value - zero
point) x scale, computed in the scale's dtype, which for a bf16 / f16 / f32 scale is one
rounding of the exact float32 product: widened to float32, one cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.quant.compressed import PACKED_DTYPE, CompressedTensors, Scheme
from ckptkit.quant.grid import SCALE_SUFFIX
from ckptkit.quant.method import Stored
from ckptkit.quant.scaled import CHUNK_ELEMENTS

if TYPE_CHECKING:
    import torch

WORD = 32
PACKED_SUFFIX = "_packed"
SHAPE_SUFFIX = "_shape"
ZERO_SUFFIX = "_zero_point"
SHAPE_DTYPES = ("int64", "int32")


def words_for(count: int, bits: int) -> int:
    """The int32 words ``count`` values of ``bits`` bits take."""
    return math.ceil(count * bits / WORD)


def _positions(count: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    starts = torch.arange(count, dtype=torch.int64) * bits
    return starts // WORD, starts % WORD


def unpacked(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` signed values (int32, ``-2 ** (bits - 1)`` ..) of the packed rows
    ``words`` [..., n], ``bits`` each, as one little-endian bit stream a row."""
    import torch

    w = torch.nn.functional.pad(words.to(torch.int64) & 0xFFFFFFFF, (0, 1))  # a zero word past the last
    index, offset = _positions(count, bits)
    stream = (w[..., index] >> offset) | (w[..., index + 1] << (WORD - offset))
    return ((stream & ((1 << bits) - 1)) - (1 << (bits - 1))).to(torch.int32)


def packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``bits``-bit ``values`` [..., count] packed as :func:`unpacked` reads them
    (int32 [..., ceil(count x bits / 32)], the last word's unused bits 0)."""
    import torch

    count = values.shape[-1]
    v = ((values.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)) << _positions(count, bits)[1]
    index = _positions(count, bits)[0].expand(*values.shape)
    out = torch.zeros(*values.shape[:-1], words_for(count, bits) + 1, dtype=torch.int64)
    out.scatter_add_(-1, index, v & 0xFFFFFFFF)  # the bits of one word never overlap: a sum is an or
    out.scatter_add_(-1, index + 1, v >> WORD)  # the part that straddles into the next word
    out = out[..., :-1]
    return (out - ((out >> 31) << 32)).to(torch.int32)  # the unsigned word's int32 bits


def _down_rows(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


class PackedCompressedTensors(CompressedTensors):
    """compressed-tensors with ``format: "pack-quantized"`` int weights of 1 to 8 bits."""

    def __init__(self, config: Any, where: Path) -> None:
        super().__init__(config, where)
        for s in self.schemes:
            if s.stored != PACKED_DTYPE or s.strategy not in ("group", "channel"):
                raise CkptkitError(
                    f"{where}: compressed-tensors pack-quantized with {s.describe()}: ckptkit reads "
                    "pack-quantized int weights in groups or channels, not mixed with other formats"
                )
        widths = sorted({s.bits for s in self.schemes})
        if len(widths) > 1:
            raise CkptkitError(f"{where}: pack-quantized groups of {' and '.join(map(str, widths))} bits: not read")
        self.bits = widths[0]
        self._shapes: dict[str, list[int]] = {}  # weight_shape tensor -> the shape its packed weight holds
        self._model: dict[tuple[tuple[int, ...], int], int] = {}  # (packed shape, groups) -> columns
        self._channel: dict[str, tuple[tuple[int, ...], int, int]] = {}  # weight -> (packed shape, columns from, to)

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
        cols = {c for (packed_shape, _), c in self._model.items() if packed_shape == tuple(shape)}
        return (*shape[:-1], cols.pop() if len(cols) == 1 else shape[-1] * WORD // self.bits)

    def dequantized_as(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        return name, self.model_shape(shape)

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        where = f"{self.where.parent / (scale.file or '')}: {scale.name}"
        if len(weight.shape) not in (2, 3):
            raise CkptkitError(
                f"{where}: {weight.name} is {list(weight.shape)}; packed weights are matrices or stacks of them"
            )
        lead, rows, words = tuple(weight.shape[:-2]), weight.shape[-2], weight.shape[-1]
        scheme = self.scheme_of(weight)
        lo, hi = (words - 1) * WORD // self.bits + 1, words * WORD // self.bits  # the columns the words may hold
        group = scheme.block[1] if scheme.strategy == "group" else hi
        whole = [c for c in range(lo, hi + 1) if c % group == 0]
        if not whole:
            raise CkptkitError(
                f"{where}: {weight.name} holds {words} words of int{self.bits} a row ({lo} to {hi} columns), "
                f"not whole groups of {group}; not read"
            )
        if scheme.strategy == "channel":  # the columns: weight_shape's (:meth:`settle`)
            self._channel[weight.name.removesuffix(PACKED_SUFFIX)] = (tuple(weight.shape), lo, hi)
        groups = scale.shape[-1] if scale.name.endswith((SCALE_SUFFIX, ZERO_SUFFIX)) and scale.shape else 0
        cols = groups * group if groups * group in whole else whole[-1]  # several: the scale says which
        if scale.name.endswith(SHAPE_SUFFIX):
            if scale.dtype not in SHAPE_DTYPES or tuple(scale.shape) != (len(weight.shape),):
                raise CkptkitError(
                    f"{where} is {scale.dtype} {list(scale.shape)}; a weight_shape is {len(weight.shape)} integers"
                )
            return
        key = (tuple(weight.shape), cols // group)
        if self._model.setdefault(key, cols) != cols:
            raise CkptkitError(f"{where}: packed weights of shape {list(weight.shape)} hold different column counts")
        self._shapes[weight.name.removesuffix(PACKED_SUFFIX) + SHAPE_SUFFIX] = [*lead, rows, cols]
        want = (*lead, rows, cols // group)
        dtypes: tuple[str, ...]
        if scale.name.endswith(ZERO_SUFFIX):
            want, dtypes = (*lead, words_for(rows, self.bits), cols // group), (PACKED_DTYPE,)
        else:
            dtypes = self.scale_dtypes
        if scale.dtype not in dtypes:
            raise CkptkitError(
                f"{where} is {scale.dtype}; pack-quantized {scale.name.rsplit('_', 1)[-1]}s are {' or '.join(dtypes)}"
            )
        if tuple(scale.shape) != want:
            raise CkptkitError(
                f"{where} is {list(scale.shape)}, but {weight.name} {list(weight.shape)} "
                f"({rows} x {cols} int{self.bits}, groups of {group}) needs {list(want)}"
            )

    def settle(self, pairs: Mapping[str, tuple[Stored, ...]], read: Callable[[str], torch.Tensor]) -> None:
        """Per channel, each weight's columns from its ``weight_shape`` (one line for columns
        its words cannot hold, or two weights of one packed shape holding different counts)."""
        settled: dict[tuple[tuple[int, ...], int], int] = {}
        for weight, (shape, lo, hi) in self._channel.items():
            if weight not in pairs:
                continue
            info = next(s for s in pairs[weight] if s.name.endswith(SHAPE_SUFFIX))
            where = f"{self.where.parent / (info.file or '')}: {info.name}"
            got = [int(x) for x in read(info.name).reshape(-1).tolist()]
            if got[:-1] != list(shape[:-1]) or not lo <= got[-1] <= hi:
                raise CkptkitError(
                    f"{where} is {got}, but {weight + PACKED_SUFFIX} {list(shape)} holds rows of {lo} to {hi} "
                    f"int{self.bits}"
                )
            key = (shape, 1)
            if settled.setdefault(key, got[-1]) != got[-1]:
                held = f"{settled[key]} and {got[-1]} columns"
                raise CkptkitError(f"{where}: packed weights of shape {list(shape)} hold {held}; not read")
            self._model[key] = got[-1]
            self._shapes[info.name] = got

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
        """[2, ..., rows, groups] float32: each group's scale, and its zero point (0: symmetric)."""
        import torch

        s = scales[0].to(torch.float32)
        if len(scales) > 2:  # packed down the rows
            zero = _down_rows(unpacked(_down_rows(scales[2]), self.bits, s.shape[-2])).float()
        else:
            zero = torch.zeros_like(s)
        return torch.stack([s, zero])

    def _parts(self, rows: int, cols: int) -> range:
        return range(0, rows, max(1, CHUNK_ELEMENTS // max(cols, 1)))

    def _cols(self, weight_shape: tuple[int, ...], groups: int) -> int:
        return self._model.get((weight_shape, groups), weight_shape[-1] * WORD // self.bits)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., rows, cols] in ``dtype``: (value - zero point) x the group's scale, one cast."""
        import torch

        cols = self._cols(tuple(weight.shape), scale.shape[-1])
        lead = weight.shape[:-1]
        words, parts = weight.reshape(-1, weight.shape[-1]), scale.reshape(2, -1, scale.shape[-1])
        rows, group = words.shape[0], cols // scale.shape[-1]
        out = torch.empty(rows, cols, dtype=dtype)
        step = self._parts(rows, cols).step
        for r in self._parts(rows, cols):
            s, z = (p[r : r + step].repeat_interleave(group, 1) for p in parts)
            out[r : r + step] = ((unpacked(words[r : r + step], self.bits, cols).float() - z) * s).to(dtype)
        return out.reshape(*lead, cols)

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The packed words whose :meth:`dequantize` with ``scale`` is ``values``."""
        import torch

        cols, lead = values.shape[-1], values.shape[:-1]
        flat, parts = values.reshape(-1, cols), scale.reshape(2, -1, scale.shape[-1])
        rows, group, half = flat.shape[0], cols // scale.shape[-1], 1 << (self.bits - 1)
        out = torch.empty(rows, words_for(cols, self.bits), dtype=torch.int32)
        step = self._parts(rows, cols).step
        for r in self._parts(rows, cols):
            s, z = (p[r : r + step].repeat_interleave(group, 1) for p in parts)
            q = (flat[r : r + step].float() / s).round() + z
            out[r : r + step] = packed(q.clamp(-half, half - 1), self.bits)
        return out.reshape(*lead, -1)

    def block_rows(self) -> int:
        return 1

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        bits = self.bits
        per = f"{WORD // bits} int{bits} a word" if WORD % bits == 0 else f"int{bits} straddling words"
        info["packing"] = f"{per} (value + {1 << (self.bits - 1)}, low bits first)"
        info["zero_points"] = "none" if all(s.symmetric for s in self.schemes) else f"int{self.bits} (asymmetric)"
        return info


CompressedTensors.packed = PackedCompressedTensors
