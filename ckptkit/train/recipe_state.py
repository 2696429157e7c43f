"""The recipe state: what resuming a run needs besides the checkpoint's model files.

One typed object, written in two layouts: ``recipe_state/recipe_state.pt`` on one device (a
flat dict: the progress fields beside ``optimizer``, ``lr_scheduler``, ``rng`` and maybe
``model``) and a DCP tree on FSDP2 (``progress.*``, ``optimizer.*``, ``rng.rank_N.*``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RunProgress:
    """Where a run is, and the schedule and global batch it belongs to."""

    seed: int
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: int | None
    global_step: int
    steps_in_epoch: int
    global_batch: int | None = None  # absent in states written before it was recorded
    world_size: int | None = None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every field name, in order (the keys a state holds)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The field names every saved state has (those without a default)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunProgress:
        """From a saved state's values (the optional fields may be missing)."""
        return cls(**{k: values[k] for k in cls.keys() if k in values})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


STATE_PARTS = ("optimizer", "lr_scheduler", "rng")
"""The parts of a state beside its progress and (maybe) model tensors."""


@dataclass
class RecipeState:
    """A saved run: its progress, optimizer and scheduler state, RNG state and, where the
    checkpoint's model files do not hold what trains exactly, the model tensors."""

    progress: RunProgress
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any]
    rng: dict[str, Any] | None  # None: a rank the saving run did not have
    model: dict[str, torch.Tensor] | None = None

    @staticmethod
    def flat_keys() -> tuple[str, ...]:
        """The keys a one-device ``recipe_state.pt`` must hold."""
        return RunProgress.required() + STATE_PARTS

    def flat(self) -> dict[str, Any]:
        """The one-device file's contents: progress fields beside the other parts."""
        parts = {k: v for k, v in self.tree().items() if k != "progress"}
        return {**self.progress.as_dict(), **parts}

    @classmethod
    def from_flat(cls, state: dict[str, Any]) -> RecipeState:
        """From a one-device file's contents (checked for :meth:`flat_keys` by the reader)."""
        return cls(
            RunProgress.from_dict(state),
            state["optimizer"],
            state["lr_scheduler"],
            state["rng"],
            state.get("model"),
        )

    def tree(self) -> dict[str, Any]:
        """The nested form (``progress`` a dict; ``model`` only when kept)."""
        tree: dict[str, Any] = {
            "progress": self.progress.as_dict(),
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "rng": self.rng,
        }
        if self.model is not None:
            tree["model"] = self.model
        return tree
