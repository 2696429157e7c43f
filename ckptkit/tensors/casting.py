"""``--dtype`` casts that never change values silently.

A cast rounds, as any narrowing does; what it may not do unasked is turn a finite value
into infinity (overflow) or a non-zero value into zero (flush). Such a cast is an error
naming the tensor unless the user passes ``--allow-lossy-cast``. Tensors that are not
floating point are never cast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    import torch

LOSSY_FLAG = "--allow-lossy-cast"


def checked_cast(tensor: torch.Tensor, dtype: torch.dtype, name: str, where: str, allow_lossy: bool) -> torch.Tensor:
    """``tensor.to(dtype)``; an error when that overflows or flushes a value, unless ``allow_lossy``."""
    import torch

    out = tensor.to(dtype)
    if allow_lossy or not tensor.dtype.is_floating_point:
        return out
    overflow = torch.isinf(out) & torch.isfinite(tensor)
    flushed = (out == 0) & (tensor != 0)
    problems = []
    if overflow.any():
        biggest = float(tensor[overflow].abs().max())
        problems.append(f"{int(overflow.sum())} value(s) overflow to inf (largest magnitude {biggest:.6g})")
    if flushed.any():
        smallest = float(tensor[flushed].abs().min())
        problems.append(f"{int(flushed.sum())} non-zero value(s) flush to 0 (smallest magnitude {smallest:.6g})")
    if problems:
        target = str(dtype).removeprefix("torch.")
        source = f" in {where}" if where else ""
        raise CkptkitError(
            f"{name}{source}: casting to {target}, {' and '.join(problems)}; pass {LOSSY_FLAG} to accept this"
        )
    return out


def cast_description(dtype: str) -> str:
    """What ``--verify`` establishes after a cast."""
    return f"verified: every tensor equals the source cast to {dtype} (tensors that are not floating point: unchanged)"
