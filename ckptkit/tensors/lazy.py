"""A tensor known by shape and dtype before it is read, and the inline tensor encoding
that ckptkit's JSON sidecars use for small tensors."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkit.io import Span, read_spans
from ckptkit.tensors.dtypes import ITEMSIZE, dtype_name, tensor_bytes, to_torch

if TYPE_CHECKING:
    import torch

    from ckptkit.io import Rows


def no_spans() -> list[Span] | None:
    return None


@dataclass
class Lazy:
    """A tensor known by shape and dtype, materialised by ``get()``.

    ``spans()`` says where the bytes ``get()`` would return lie in the source files (byte
    ranges, concatenated in order) when they can be copied file to file, else None.
    ``rows(order)`` is set only for a tensor stored with its rows permuted (Meta's Q/K in
    HF's layout): where its rows ``order`` (in that order) lie, the two permutations
    composed before any span is made, not one span per row; None when its bytes do not
    lie in the source as stored (as ``spans()`` would say). Unset: ask ``spans()``.
    ``raw``, where set, returns those bytes (generated or recorded tensors, from memory
    without torch; a checked scale, read and checked without torch where its method can).
    ``pieces(lead)``, where set, returns ``get()``'s result flat, in order, a piece at a
    time (a tensor, or its bytes), each valid until the one after the next is asked for (a
    dequantized weight: written while the next piece is made, never held whole); ``lead``:
    where in a page of the output file the first byte goes (pieces made in memory may be
    placed to match, for a direct write).
    """

    shape: tuple[int, ...]
    dtype: str  # a name, e.g. "bfloat16"
    get: Callable[[], torch.Tensor]
    file: str = ""
    spans: Callable[[], list[Span] | None] = no_spans
    raw: Callable[[], bytes] | None = None
    rows: Callable[[Rows], list[Span] | None] | None = None
    pieces: Callable[[int], Iterator[torch.Tensor | memoryview]] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def bytes_lazy(shape: tuple[int, ...], dtype: str, raw: Callable[[], bytes], file: str = "") -> Lazy:
    """A lazy tensor whose bytes come from ``raw()``; ``get()`` builds the torch tensor."""
    return Lazy(shape, dtype, lambda: tensor_from_bytes(raw(), dtype, shape), file, raw=raw)


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    import torch

    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(tuple(shape), dtype=to_torch(dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(to_torch(dtype)).reshape(tuple(shape))


def encode_lazy(lazy: Lazy) -> dict[str, Any]:
    """:func:`encode_tensor` of ``lazy.get()``, from its bytes where it has them in memory
    or stored as they are (no torch needed)."""
    if lazy.raw is not None:
        data = lazy.raw()
    else:
        spans = lazy.spans()
        if spans is None:
            return encode_tensor(lazy.get())
        data = read_spans(spans)
    return _encoded(lazy.dtype, lazy.shape, data)


def _encoded(dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data": base64.b64encode(data).decode()}


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    return _encoded(dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t))


def decoded_lazy(d: dict[str, Any]) -> Lazy:
    """The lazy tensor of an :func:`encode_tensor` record (no torch until ``get()``)."""
    data = base64.b64decode(d["data"])
    return bytes_lazy(tuple(d["shape"]), d["dtype"], lambda: data)


def decode_tensor(d: dict[str, Any]) -> torch.Tensor:
    return decoded_lazy(d).get()
