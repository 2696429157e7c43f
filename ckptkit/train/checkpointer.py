"""The recipes' checkpointer: reads the base model in any format and writes checkpoints
in the same format, file names and shard partition, atomically, with what resuming needs.

A checkpoint folder (``output_dir/epoch_N`` or ``output_dir/step_N``) holds the model
(for LoRA: merged) laid out like the input, the input's non-weight files, the LoRA
adapter in PEFT's format in ``adapter/`` (a subfolder, so that transformers loads the
folder itself as the merged model), and ``recipe_state.pt`` (not in the final checkpoint).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptkit.checkpoint import open_checkpoint
from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig
from ckptkit.save_like import save_checkpoint_like
from ckptkit.train.config import get
from ckptkit.train.lora import lora_modules
from ckptkit.train.peft_io import ADAPTER_WEIGHTS, copy_lora_weights, read_lora_weights, save_adapter

RECIPE_STATE = "recipe_state.pt"
ADAPTER_DIR = "adapter"
STATE_KEYS = (
    "seed", "epochs_run", "total_epochs", "max_steps_per_epoch", "global_step", "steps_in_epoch",
    "optimizer", "lr_scheduler", "rng",
)  # fmt: skip


class Checkpointer:
    """Configured by the ``checkpointer:`` section (see docs/training.md) plus
    ``resume_from_checkpoint``."""

    def __init__(self, cfg: dict[str, Any]):
        self.checkpoint_dir = Path(get(cfg, "checkpointer.checkpoint_dir", required=True))
        self.checkpoint_files = get(cfg, "checkpointer.checkpoint_files")
        self.model_type = get(cfg, "checkpointer.model_type")
        self.output_dir = Path(get(cfg, "checkpointer.output_dir", required=True))
        self.adapter_checkpoint = get(cfg, "checkpointer.adapter_checkpoint")
        self.recipe_checkpoint = get(cfg, "checkpointer.recipe_checkpoint")
        self.resume = bool(get(cfg, "resume_from_checkpoint", False))
        self.dtypes: dict[str, str] = {}  # canonical name -> stored dtype name

    # --- reading -------------------------------------------------------------------
    def load_base(self) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """The base model as (canonical config, canonical state dict), stored dtypes."""
        with open_checkpoint(self.checkpoint_dir, model_type=self.model_type) as ckpt:
            if self.checkpoint_files:
                found = set(ckpt.raw.files)
                listed = {Path(f).name for f in self.checkpoint_files}
                if listed != found:
                    odd = sorted(listed ^ found)
                    raise CkptkitError(
                        f"checkpointer.checkpoint_files does not match the weight files in {self.checkpoint_dir} "
                        f"({', '.join(odd[:3])}); leave it unset to use every weight file"
                    )
            self.dtypes = {k: v.dtype for k, v in ckpt.tensors.items()}
            return ckpt.config, {k: v.get() for k, v in ckpt.tensors.items()}

    def load_resume_weights(self) -> dict[str, torch.Tensor]:
        """The model weights saved beside the recipe state being resumed."""
        folder = Path(self.recipe_checkpoint).parent
        with open_checkpoint(folder, model_type=self.model_type) as ckpt:
            return {k: v.get() for k, v in ckpt.tensors.items()}

    def load_recipe_state(self) -> dict[str, Any] | None:
        """The state to resume from, or None when not resuming; one-line errors name the key."""
        if not self.resume:
            return None
        if not self.recipe_checkpoint:
            raise CkptkitError(
                "resume_from_checkpoint is true but checkpointer.recipe_checkpoint is not set "
                f"(point it at the {RECIPE_STATE} of the checkpoint to resume)"
            )
        path = Path(self.recipe_checkpoint)
        if not path.is_file():
            raise CkptkitError(
                f"{path}: recipe state not found; set checkpointer.recipe_checkpoint to an existing {RECIPE_STATE}"
            )
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable file: the message below says which and why
            raise CkptkitError(
                f"{path}: not a readable recipe state ({type(e).__name__}); check checkpointer.recipe_checkpoint"
            ) from None
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise CkptkitError(
                f"{path}: not a ckptkit recipe state (no {', '.join(missing[:3])}); "
                "check checkpointer.recipe_checkpoint"
            )
        return state

    def check_state(self, state: dict[str, Any], seed: int, epochs: int, max_steps: int | None) -> None:
        """Refuse a recipe state written by a run with a different schedule."""
        for key, want in (("seed", seed), ("total_epochs", epochs), ("max_steps_per_epoch", max_steps)):
            if state[key] != want:
                name = {"total_epochs": "epochs"}.get(key, key)
                raise CkptkitError(
                    f"{self.recipe_checkpoint}: was written with {name}={state[key]} but the config says {want}; "
                    f"set {name} to match or point checkpointer.recipe_checkpoint at the right run"
                )

    def load_adapter_into(self, model: nn.Module) -> None:
        """Copy the adapter to resume from into the model's (already added) LoRA modules."""
        if not self.adapter_checkpoint:
            raise CkptkitError(
                "resuming LoRA needs checkpointer.adapter_checkpoint (the checkpoint folder or its adapter file)"
            )
        path = Path(self.adapter_checkpoint)
        folder = path.parent if path.is_file() else path
        if not (folder / ADAPTER_WEIGHTS).is_file() and (folder / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file():
            folder = folder / ADAPTER_DIR  # the checkpoint folder was given
        if not (folder / ADAPTER_WEIGHTS).is_file():
            raise CkptkitError(f"{path}: no {ADAPTER_WEIGHTS} there; check checkpointer.adapter_checkpoint")
        adapter = read_lora_weights(folder, model.config.model_type)
        modules = lora_modules(model)
        if set(adapter.lora) != set(modules):
            odd = sorted(set(adapter.lora) ^ set(modules))
            raise CkptkitError(
                f"{folder / ADAPTER_WEIGHTS}: adapts other modules than the config's lora section "
                f"({', '.join(odd[:3])}); "
                "check checkpointer.adapter_checkpoint"
            )
        try:
            copy_lora_weights(model, adapter)
        except CkptkitError as e:
            raise CkptkitError(f"{folder / ADAPTER_WEIGHTS}: {e}; check checkpointer.adapter_checkpoint") from None

    # --- writing -------------------------------------------------------------------
    def save(
        self,
        name: str,
        model_state: dict[str, torch.Tensor],
        adapter_model: nn.Module | None = None,
        recipe_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write ``output_dir/name`` completely, or leave what was there before."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        final = self.output_dir / name
        tmp = self.output_dir / f".{name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_checkpoint_like(self.checkpoint_dir, model_state, tmp, model_type=self.model_type)
            if adapter_model is not None:
                save_adapter(adapter_model, tmp / ADAPTER_DIR, base_model_name_or_path=str(self.checkpoint_dir))
            if recipe_state is not None:
                torch.save(recipe_state, tmp / RECIPE_STATE)
            old = self.output_dir / f".{name}.old-{os.getpid()}"
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
