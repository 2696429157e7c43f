"""``--dtype`` casts that never overflow silently, and say what they rounded away.

A cast rounds, as any narrowing does; what it may not do unasked is turn a finite value
into infinity (overflow): that is an error naming the tensor unless the user passes
``--allow-lossy-cast``. Values below the target's normal range (underflow: rounded to 0
or to a subnormal, bits lost) are what a user asking for float16 asks for (torch and
llama.cpp cast them the same way): they are counted, over the whole conversion, into one
note (:func:`counted_casts`). Tensors that are not floating point are never cast.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError, note

if TYPE_CHECKING:
    import torch

LOSSY_FLAG = "--allow-lossy-cast"


@dataclass
class Underflows:
    """Values a conversion's casts rounded below the target's normal range, per target dtype."""

    to_zero: dict[str, int] = field(default_factory=dict)  # dtype -> non-zero values that became 0
    to_subnormal: dict[str, int] = field(default_factory=dict)  # dtype -> values rounded to a subnormal
    tensors: dict[str, set[str]] = field(default_factory=dict)  # dtype -> the tensors that held them

    def add(self, dtype: str, name: str, to_zero: int, to_subnormal: int) -> None:
        self.to_zero[dtype] = self.to_zero.get(dtype, 0) + to_zero
        self.to_subnormal[dtype] = self.to_subnormal.get(dtype, 0) + to_subnormal
        self.tensors.setdefault(dtype, set()).add(name)

    def notes(self) -> list[str]:
        """One note per target dtype (a conversion casts to one): the counts, aggregated."""
        return [
            note(
                f"casting to {dtype}: {self.to_zero[dtype]} non-zero value(s) underflow to 0 and "
                f"{self.to_subnormal[dtype]} round to a subnormal, in {len(names)} tensor(s) "
                "(as torch and llama.cpp cast them)",
                "to keep every bit of them, convert without --dtype or with --dtype float32",
            )
            for dtype, names in self.tensors.items()
        ]


_COUNTING: ContextVar[Underflows | None] = ContextVar("ckptkit_underflows", default=None)


@contextmanager
def counted_casts() -> Iterator[Underflows]:
    """Count the underflows of every :func:`checked_cast` made inside (in this thread)."""
    counts = Underflows()
    token = _COUNTING.set(counts)
    try:
        yield counts
    finally:
        _COUNTING.reset(token)


def checked_cast(tensor: torch.Tensor, dtype: torch.dtype, name: str, where: str, allow_lossy: bool) -> torch.Tensor:
    """``tensor.to(dtype)``; an error when that overflows a value, unless ``allow_lossy``.
    Values that underflow are counted where :func:`counted_casts` counts."""
    import torch

    out = tensor.to(dtype)
    if allow_lossy or not tensor.dtype.is_floating_point:
        return out
    overflow = torch.isinf(out) & torch.isfinite(tensor)
    if overflow.any():
        biggest = float(tensor[overflow].abs().max())
        target = str(dtype).removeprefix("torch.")
        source = f" in {where}" if where else ""
        raise CkptkitError(
            f"{name}{source}: casting to {target}, {int(overflow.sum())} value(s) overflow to inf "
            f"(largest magnitude {biggest:.6g}); pass {LOSSY_FLAG} to accept this"
        )
    counts = _COUNTING.get()
    if counts is not None:
        to_zero, to_subnormal = underflows(tensor, out)
        if to_zero or to_subnormal:
            counts.add(str(dtype).removeprefix("torch."), name, to_zero, to_subnormal)
    return out


def underflows(tensor: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(non-zero values of ``tensor`` that are 0 in ``out``, values that ``out`` holds as a
    subnormal other than they were): what casting ``tensor`` to ``out``'s dtype underflowed."""
    import torch

    to_zero = int(((out == 0) & (tensor != 0)).sum())
    tiny = out.abs() < torch.finfo(out.dtype).tiny
    sub = tiny & (out != 0)
    if not bool(sub.any()):
        return to_zero, 0
    inexact = out[sub].to(torch.float64) != tensor[sub].to(torch.float64)
    return to_zero, int(inexact.sum())


def cast_description(dtype: str) -> str:
    """What ``--verify`` establishes after a cast."""
    return f"verified: every tensor equals the source cast to {dtype} (tensors that are not floating point: unchanged)"
