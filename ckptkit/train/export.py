"""Merged export: base weights with LoRA folded in, written in the base checkpoint's own format."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.tensors.lazy import Lazy
from ckptkit.train.lora import base_state_dict, merged_weight
from ckptkit.train.peft_experts import MoeParam, adapted_shape, stacked_param
from ckptkit.train.peft_io import AdapterWeights, check_base_copies, read_lora_weights
from ckptkit.train.stacked_lora import delta


def export_merged(model: nn.Module, base_checkpoint: str | Path, out_dir: str | Path) -> None:
    """Write ``model``'s weights with its adapters merged, laid out like ``base_checkpoint``.

    Format, file names, shards and dtype follow the base checkpoint
    (:func:`ckptkit.save_checkpoint_like`); the merge is computed in float32.
    """
    from ckptkit.save_like import save_checkpoint_like

    save_checkpoint_like(str(base_checkpoint), base_state_dict(model, merged=True), str(out_dir))


def merge_adapter_into_checkpoint(
    base_checkpoint: str | Path, adapter_dir: str | Path, out_dir: str | Path, model_type: str | None = None
) -> None:
    """Fold a PEFT LoRA adapter into a checkpoint on disk, without building a model.

    Each targeted weight becomes ``(W.float() + scaling * B @ A).to(W.dtype)`` (a DoRA
    adapter's, PEFT's merge: :func:`~ckptkit.train.lora.merged_weight`): one rounding to the
    stored dtype. Every other tensor passes through untouched. Tensors
    are read one at a time, as the writer reaches them.
    """
    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.plan import dequantized_checkpoint
    from ckptkit.save_like import save_checkpoint_like

    with open_checkpoint(base_checkpoint, model_type=model_type) as stored:
        ckpt = dequantized_checkpoint(stored, "float32")  # block FP8, MXFP4: merged scaled, written back quantized
        adapter = read_lora_weights(adapter_dir, ckpt.config, str(base_checkpoint), "merge it into the model", True)
        check_base_copies(adapter, {k: ckpt.tensors[k].get() for k in adapter.base_copies if k in ckpt.tensors})
        state: dict[str, Lazy] = dict(ckpt.tensors)
        for module, w in adapter.lora.items():
            key, shape = adapted_shape(ckpt.config, module, w.a, w.b)
            if key not in state:
                raise CkptkitError(f"adapter targets {key}, which the checkpoint does not have")
            base = state[key]
            if shape != tuple(base.shape):
                raise CkptkitError(f"adapter for {key} has shape {shape}, weight is {tuple(base.shape)}")
            state[key] = Lazy(base.shape, base.dtype, partial(_merged, base, w, stacked_param(ckpt.config, module)))
        for key, whole in adapter.replaced.items():  # modules_to_save: the adapter's tensor, in the base's dtype
            if key not in state or tuple(whole.shape) != tuple(state[key].shape):
                raise CkptkitError(f"adapter replaces {key} with shape {tuple(whole.shape)}, which does not fit")
            state[key] = Lazy(state[key].shape, state[key].dtype, partial(_replaced, whole, state[key].dtype))
        save_checkpoint_like(str(base_checkpoint), state, str(out_dir), model_type=model_type)


def _replaced(whole: torch.Tensor, dtype: str) -> torch.Tensor:
    from ckptkit.tensors.dtypes import to_torch

    return whole.to(to_torch(dtype))


def _merged(base: Lazy, w: AdapterWeights, stacked: MoeParam | None = None) -> torch.Tensor:
    if stacked is not None:  # a stacked expert tensor (gpt-oss, Llama 4): PEFT's merge
        weight = base.get()
        return weight + delta(w.a, w.b, w.scaling, stacked.experts, stacked.transposed).to(weight.dtype)
    return merged_weight(base.get(), w.a, w.b, w.scaling, w.magnitude)
