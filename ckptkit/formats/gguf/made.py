"""One HF tensor made from a GGUF's tensors (:mod:`.hf_view`), and the GGUF's tensors as the
makers read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError
from ckptkit.io import take

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import RawCheckpoint
    from ckptkit.formats.tensor_info import TensorInfo
    from ckptkit.io import Span


@dataclass
class Made:
    """One HF tensor: its shape, dtype, how to make it, where its bytes lie (None: computed)."""

    shape: tuple[int, ...]
    dtype: str
    get: Callable[[], torch.Tensor]
    spans: Callable[[], list[Span] | None] = field(default=lambda: None)


class Reader:
    """The GGUF's tensors as the view reads them: by GGUF name, each use recorded, the last
    whole tensor kept (a merged experts tensor is sliced once per expert)."""

    def __init__(self, raw: RawCheckpoint) -> None:
        self.raw = raw
        self.used: set[str] = set()
        self._last: tuple[str, torch.Tensor] | None = None

    def has(self, name: str) -> bool:
        return name in self.raw.infos

    def info(self, name: str) -> TensorInfo:
        if name not in self.raw.infos:
            raise CkptkitError(f"{self.raw.root / self.raw.config_name}: tensor {name!r} is missing")
        self.used.add(name)
        return self.raw.infos[name]

    def read(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self.raw.read(name))
        return self._last[1]

    def renamed(self, name: str) -> Made:
        info = self.info(name)
        return Made(info.shape, info.dtype, lambda: self.raw.read(name), lambda: self.raw.spans(name))


def expert(reader: Reader, merged: str, e: int) -> Made:
    """Expert ``e`` of the merged tensor ``merged`` [E, rows, cols]: its slice, bytes where they lie."""
    info = reader.info(merged)
    shape = info.shape[1:]

    def spans() -> list[Span] | None:
        whole = reader.raw.spans(merged)
        if whole is None:
            return None
        size = sum(s.nbytes for s in whole) // info.shape[0]
        return take(whole, e * size, size)

    return Made(shape, info.dtype, lambda: reader.read(merged)[e].clone(), spans)
