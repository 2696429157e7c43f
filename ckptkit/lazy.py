"""A tensor known by shape and dtype before it is read, and the inline tensor encoding
that ckptkit's JSON sidecars use for small tensors."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkit.dtypes import ITEMSIZE, dtype_name, to_torch
from ckptkit.rawcopy import Span, read_spans

if TYPE_CHECKING:
    import torch


def no_spans() -> list[Span] | None:
    return None


@dataclass
class Lazy:
    """A tensor known by shape and dtype, materialised by ``get()``.

    ``spans()`` says where the bytes ``get()`` would return lie in the source files (byte
    ranges, concatenated in order) when they can be copied file to file, else None.
    """

    shape: tuple[int, ...]
    dtype: str  # a name, e.g. "bfloat16"
    get: Callable[[], torch.Tensor]
    file: str = ""
    spans: Callable[[], list[Span] | None] = no_spans

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def encode_lazy(lazy: Lazy) -> dict[str, Any]:
    """:func:`encode_tensor` of ``lazy.get()``, from its stored bytes where it has them
    (no torch needed)."""
    spans = lazy.spans()
    if spans is None:
        return encode_tensor(lazy.get())
    data = read_spans(spans)
    return {"dtype": lazy.dtype, "shape": list(lazy.shape), "data": base64.b64encode(data).decode()}


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    import torch

    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def decode_tensor(d: dict[str, Any]) -> torch.Tensor:
    import torch

    buf = bytearray(base64.b64decode(d["data"]))
    return torch.frombuffer(buf, dtype=torch.uint8).view(to_torch(d["dtype"])).reshape(d["shape"]).clone()
