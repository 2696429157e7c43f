"""Write a canonical state dict back in the layout of the checkpoint it came from.

A quantized source (block FP8, MXFP4) is read by the trainer dequantized
(:func:`~ckptkit.plan.dequantized_checkpoint`), so the state dict holds its weights in that
view; they go back quantized as the source is: a weight equal to the source's dequantized
one keeps its stored bytes and scale, any other is quantized afresh by the source's method
(block FP8: ``amax / 448`` per block, as ``--dtype fp8`` makes them), under the source's
``quantization_config``. With ``dtype`` (``bfloat16``) they are written dequantized in that
dtype, without a ``quantization_config``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ckptkit.checkpoint import Checkpoint, Lazy, open_checkpoint
from ckptkit.convert import Options, Result, check_destination, plan_conversion, write_checkpoint, write_files
from ckptkit.errors import CkptkitError
from ckptkit.plan import dequantized_checkpoint
from ckptkit.quant import Quantization
from ckptkit.quant.method import QuantMethod
from ckptkit.tensors.dtypes import to_torch

Value = torch.Tensor | Lazy


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
    source: str | Path,
    state_dict: dict[str, torch.Tensor],
    folder: Path,
    model_type: str | None = None,
    dtype: str | None = None,
) -> None:
    """:func:`save_checkpoint_like` into an existing folder that the caller publishes;
    ``dtype``: the dtype a quantized source's weights are written dequantized in (None: quantized)."""
    with open_checkpoint(source, model_type=model_type) as src:
        mine = _like(src, state_dict, dtype)
        write_files(mine, plan_conversion(mine, Options(src.format)), folder)


def _like(src: Checkpoint, state_dict: Mapping[str, Value], dtype: str | None = None) -> Checkpoint:
    """``src`` with its tensors replaced by ``state_dict``'s (same names, shapes; src's dtypes);
    a quantized ``src``'s by the names of its dequantized view (see the module's docstring)."""
    if src.quant is not None:
        return _like_quantized(src, state_dict, dtype)
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


def _like_quantized(src: Checkpoint, state_dict: Mapping[str, Value], dtype: str | None) -> Checkpoint:
    """A quantized ``src`` with its tensors replaced by ``state_dict``'s, keyed as its
    dequantized view: written back quantized (``dtype`` None) or dequantized in ``dtype``."""
    quant = src.quant
    assert quant is not None
    view = dequantized_checkpoint(src, dtype or "float32")
    plain = _like(view, state_dict)
    if dtype is not None:
        return dataclasses.replace(plain, recorded_origin=src.own_layout)
    method = quant.method
    tensors: dict[str, Lazy] = {}
    scales: dict[str, tuple[Lazy, ...]] = {}
    for name, stored in src.tensors.items():
        if name not in quant.scales:
            tensors[name] = plain.tensors[name]
            continue
        value = state_dict[method.dequantized_as(name, stored.shape)[0]]
        made = _Requantized(method, stored, quant.scales[name], value)
        tensors[name] = Lazy(stored.shape, stored.dtype, made.weight, stored.file)
        scales[name] = tuple(
            Lazy(s.shape, s.dtype, functools.partial(made.scale, i), s.file) for i, s in enumerate(quant.scales[name])
        )
    return dataclasses.replace(src, tensors=tensors, quant=Quantization(method, scales), recorded_origin=src.own_layout)


@dataclasses.dataclass
class _Requantized:
    """One quantized weight of the source and its new value: the stored bytes and scales when
    the value is the source's dequantized weight, else the value quantized by the method
    (computed once, with the weight; the scales are taken after it)."""

    method: QuantMethod
    stored: Lazy
    scales: tuple[Lazy, ...]
    value: Value
    made: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
    taken: set[int] = dataclasses.field(default_factory=set)  # -1: the weight, i: scale i

    def weight(self) -> torch.Tensor:
        return self._take(-1)

    def scale(self, i: int) -> torch.Tensor:
        return self._take(i)

    def _take(self, part: int) -> torch.Tensor:
        if self.made is None:
            self.made = self._compute()
        made = self.made
        self.taken.add(part)
        if len(self.taken) == len(self.scales) + 1:  # all written: let go
            self.made, self.taken = None, set()
        return made[0] if part < 0 else made[1][part]

    def _compute(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        value = (self.value.get() if isinstance(self.value, Lazy) else self.value).detach().cpu()
        weight, scales = self.stored.get(), tuple(s.get() for s in self.scales)
        if torch.equal(value, self.method.loaded(weight, self.method.combined(scales), value.dtype)):
            return weight, scales  # unchanged: the stored bytes
        if len(scales) != 1 or type(self.method).quantize is QuantMethod.quantize:
            raise CkptkitError(
                f"{self.method.name} weights cannot be quantized again by ckptkit; write them dequantized "
                "(lora.merge_dtype: bf16)"
            )
        q, scale = self.method.quantize(self.method.unloaded(value.float()))
        return q, (scale.to(scales[0].dtype),)
