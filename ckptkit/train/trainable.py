"""What trains and what a checkpoint holds: every weight, or LoRA adapters on a frozen base.

The training loop (:mod:`ckptkit.train.loop`) asks a trainable to adapt the model built on
the meta device, to say which tensors the recipe state keeps, and which model files and
extras a checkpoint writes. Tensors are reached by name through the placement's ``full``
(on one device the model's own; under FSDP2 read back from the sharded checkpoint just
written), one at a time, so no process holds the whole model while saving.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig
from ckptkit.tensors.dtypes import dtype_name
from ckptkit.train import nf4
from ckptkit.train.checkpointer import Checkpointer
from ckptkit.train.lora import ADAPTER_SUFFIXES, apply_lora, dora_magnitude, lora_modules, merged_weight
from ckptkit.train.lora_targets import check_targets
from ckptkit.train.peft_io import prepare_for_peft
from ckptkit.train.schema import LoRAConfig
from ckptkit.train.stacked_lora import delta, stacked_modules

Gather = Callable[[str], torch.Tensor]
"""A whole tensor of the model's state dict, by name."""
ModelFiles = tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]
"""The model tensors a checkpoint writes: their shapes, and a function giving each whole."""


class Trainable:
    """What trains, where its starting values come from, and what a save writes."""

    weights_from_resumed_checkpoint = False
    """Resuming starts from the weights of the checkpoint resumed (else from the base)."""

    def check(self, model_cfg: ModelConfig) -> None:
        """Refuse, before any weight is read, what would fail later."""

    def build(self, model: nn.Module, checkpointer: Checkpointer) -> None:
        """Adapt ``model`` (on the meta device); tensors made here keep their values."""

    def placed(self, model: nn.Module) -> None:
        """Adapt ``model`` once its tensors hold their values on their device."""

    def prepare(self, checkpointer: Checkpointer, writer: bool) -> None:
        """Last setup before training (``writer``: on the rank that writes checkpoints)."""

    def state_tensors(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Model tensors the recipe state keeps (None: none beyond the checkpoint's files)."""
        return None

    def sharded_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model tensors a sharded (DCP) checkpoint keeps: what trains; resuming reads
        them back and the model files are converted from them (a frozen base is read from
        the input)."""
        raise NotImplementedError

    def model_files(self, model: nn.Module, full: Gather, final: bool) -> ModelFiles | None:
        """The model tensors a checkpoint writes (None: no model files). Only ``full`` may be
        used once this returns: under FSDP2 the files are written while training goes on."""
        raise NotImplementedError

    def source(self, model: nn.Module, tensor: Gather) -> Gather:
        """Where the model's tensors still on the meta device get their values: ``tensor``
        (the base checkpoint's), for those the trainable does not make from it."""
        return tensor

    def extra(self, model: nn.Module, full: Gather, checkpointer: Checkpointer) -> Callable[[Path], None] | None:
        """What else goes into a checkpoint folder, written by the writing rank (the function
        returned may use ``full`` and the model's structure, never its tensors)."""
        return None


class FullWeights(Trainable):
    """Every weight trains; checkpoints hold the model in the input's format, and the recipe
    state the full-precision weights when the checkpoint's dtype rounds them."""

    weights_from_resumed_checkpoint = True

    def __init__(self) -> None:
        self.rounds = False

    def build(self, model: nn.Module, checkpointer: Checkpointer) -> None:
        stored = checkpointer.dtypes
        self.rounds = any(stored[k] != dtype_name(v.dtype) for k, v in model.state_dict().items() if k in stored)

    def state_tensors(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return model.state_dict() if self.rounds else None

    def sharded_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def model_files(self, model: nn.Module, full: Gather, final: bool) -> ModelFiles:
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}, lambda k: full(k).detach()


class LoRAAdapters(Trainable):
    """LoRA adapters train on the chosen projections, the base stays frozen. Checkpoints hold
    the adapter in PEFT's format (``adapter/``) and, as ``lora.save_merged`` says, the merged
    model in the input's format. Resuming reads the adapter of the checkpoint resumed (or
    ``checkpointer.adapter_checkpoint``)."""

    def __init__(self, cfg: LoRAConfig) -> None:
        self.cfg = cfg

    def check(self, model_cfg: ModelConfig) -> None:
        check_targets(list(self.cfg.targets), model_cfg, self.cfg.dropout)
        moe = sorted({"experts", "router"} & set(self.cfg.targets))
        if self.cfg.use_dora and moe:
            raise CkptkitError(
                f"lora.use_dora: PEFT has no DoRA for {' and '.join(moe)} (stacked tensors); "
                f"remove {' and '.join(moe)} from lora.targets or set lora.use_dora to false"
            )

    def build(self, model: nn.Module, checkpointer: Checkpointer) -> None:
        cfg = self.cfg
        apply_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.dropout, use_dora=cfg.use_dora)
        for module in lora_modules(model).values():  # on the CPU in module order: the same draws on any placement
            module.reset_lora(torch.device("cpu"), module.lora_a.dtype)
        prepare_for_peft(model)  # fused modules share one A; PEFT names checked now, not at save
        if checkpointer.resume:
            checkpointer.load_adapter_into(model)
        checkpointer.merge_dtype = "bfloat16" if cfg.merge_dtype == "bf16" else None
        self.checkpointer = checkpointer
        if cfg.quantize_base == "nf4":  # on the meta device: FSDP2 shards the NF4 layout
            nf4.quantize_base(model)

    def placed(self, model: nn.Module) -> None:
        if self.cfg.quantize_base == "nf4":
            nf4.quantize_base(model)

    def prepare(self, checkpointer: Checkpointer, writer: bool) -> None:
        if writer:
            checkpointer.prepare_peft_base()  # an HF base for the adapters' base_model_name_or_path

    def source(self, model: nn.Module, tensor: Gather) -> Gather:
        dtypes = {k: v.dtype for k, v in model.state_dict().items()}

        def read(key: str) -> torch.Tensor:  # DoRA's magnitude: the row norms of the base weight
            if not key.endswith(".lora_magnitude"):
                return tensor(key)
            weight = key.removesuffix(".lora_magnitude") + ".weight"
            base = tensor(weight).to(dtypes[weight])
            if self.cfg.quantize_base == "nf4":  # QDoRA: of the dequantized NF4 weight it trains on, as PEFT's
                base = nf4.dequantize(nf4.to_nf4(base))
            return dora_magnitude(base, dtypes[key])

        return read

    def sharded_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v for k, v in model.state_dict().items() if k.endswith(ADAPTER_SUFFIXES)}

    def model_files(self, model: nn.Module, full: Gather, final: bool) -> ModelFiles | None:
        when = self.cfg.save_merged
        if not (when == "every" or (final and when == "final")):
            return None  # an adapter-only checkpoint
        weights, modules, stacked = model.state_dict(), lora_modules(model), stacked_modules(model)
        quantized = {k for k, v in weights.items() if nf4.local_is_nf4(v)}

        def merged(key: str) -> torch.Tensor:
            name = key.removesuffix(".weight")
            w = full(key).detach()
            if key in quantized:  # QLoRA: the base lora.merge_base names
                # under FSDP2 ``full`` reads the frozen base from the input: NF4 again, as trained
                w = w if nf4.is_nf4(w) else nf4.to_nf4(w)
                w = nf4.merge_base_weight(self.cfg.merge_base, w, lambda: _base_tensor(self.checkpointer, key))
            if key in stacked:  # a stacked expert tensor: PEFT's merge
                m = stacked[key]
                a, b = (full(f"{key}_lora.{part}").detach() for part in ("lora_a", "lora_b"))
                return w + delta(a, b, m.scaling, m.experts, m.transposed).to(w.dtype)
            if name not in modules or not key.endswith(".weight"):
                return w
            a, b = (full(f"{name}.{part}").detach() for part in ("lora_a", "lora_b"))
            magnitude = full(f"{name}.lora_magnitude").detach() if modules[name].use_dora else None
            return merged_weight(w, a, b, modules[name].scaling, magnitude)

        return {k: tuple(v.shape) for k, v in weights.items() if not k.endswith(ADAPTER_SUFFIXES)}, merged

    def extra(self, model: nn.Module, full: Gather, checkpointer: Checkpointer) -> Callable[[Path], None]:
        names = [k for k in model.state_dict() if k.endswith(ADAPTER_SUFFIXES)]

        def write(folder: Path) -> None:  # reads the adapters when it runs, not the model
            checkpointer.write_adapter(model, folder, {k: full(k).cpu() for k in names})

        return write


def _base_tensor(checkpointer: Checkpointer, key: str) -> torch.Tensor:
    """One tensor of the input checkpoint, read again (QLoRA's ``merge_base: original``)."""
    with checkpointer.open_base() as base:
        return base.tensors[key].get()
