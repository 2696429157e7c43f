"""Write a canonical state dict back in the layout of the checkpoint it came from."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ckptkit.checkpoint import Checkpoint, Lazy, open_checkpoint
from ckptkit.convert import Options, Result, check_destination, plan_conversion, write_checkpoint, write_files
from ckptkit.errors import CkptkitError
from ckptkit.tensors.dtypes import to_torch


def save_checkpoint_like(
    source: str | Path,
    state_dict: Mapping[str, torch.Tensor | Lazy],
    out_dir: str | Path,
    force: bool = False,
    quiet: bool = True,
    model_type: str | None = None,
) -> Result:
    """Write canonical ``state_dict`` in ``source``'s own format, file names, shards and dtypes.

    Tensors the model does not use (``rope.freqs``...) and non-weight files are carried
    over from ``source``. ``out_dir`` is complete or absent afterwards. A :class:`Lazy`
    value is fetched only when the writer reaches it (the distributed recipes gather
    each sharded tensor then).
    """
    source, out_dir = Path(source), Path(out_dir)
    with open_checkpoint(source, model_type=model_type) as src:
        mine = _like(src, state_dict)
        check_destination(source, out_dir, force, src.fmt)  # a GGUF's: a file path ending in .gguf
        return write_checkpoint(mine, out_dir, Options(src.format), quiet=quiet, force=force)


def write_like(
    source: str | Path, state_dict: dict[str, torch.Tensor], folder: Path, model_type: str | None = None
) -> None:
    """:func:`save_checkpoint_like` into an existing folder that the caller publishes."""
    with open_checkpoint(source, model_type=model_type) as src:
        mine = _like(src, state_dict)
        write_files(mine, plan_conversion(mine, Options(src.format)), folder)


def _like(src: Checkpoint, state_dict: Mapping[str, torch.Tensor | Lazy]) -> Checkpoint:
    """``src`` with its tensors replaced by ``state_dict``'s (same names, shapes; src's dtypes)."""
    missing = [k for k in src.tensors if k not in state_dict]
    extra = [k for k in state_dict if k not in src.tensors]
    if missing or extra:
        raise CkptkitError(f"state dict does not match {src.path}: missing {missing[:3]}, unexpected {extra[:3]}")
    tensors = {}
    for name, lazy in src.tensors.items():
        t = state_dict[name]
        if tuple(t.shape) != lazy.shape:
            raise CkptkitError(f"state dict tensor {name} is {list(t.shape)}, {src.path} has {list(lazy.shape)}")
        fetch: Callable[[], torch.Tensor] = t.get if isinstance(t, Lazy) else functools.partial(_same, t)
        tensors[name] = Lazy(lazy.shape, lazy.dtype, functools.partial(_on_cpu, fetch, to_torch(lazy.dtype)))
    return dataclasses.replace(src, tensors=tensors, recorded_origin=src.own_layout)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _on_cpu(fetch: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return fetch().detach().to("cpu", dtype).contiguous()
