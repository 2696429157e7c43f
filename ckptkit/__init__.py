"""ckptkit: lossless, streaming conversion of LLM checkpoints, and a small trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ckptkit.checkpoint import load_checkpoint, open_checkpoint
    from ckptkit.save_like import save_checkpoint_like

__all__ = ["__version__", "load_checkpoint", "open_checkpoint", "save_checkpoint_like"]


def __getattr__(name: str) -> Any:  # import torch only when the library is used
    if name in ("load_checkpoint", "open_checkpoint"):
        from ckptkit import checkpoint

        return getattr(checkpoint, name)
    if name == "save_checkpoint_like":
        from ckptkit.save_like import save_checkpoint_like

        return save_checkpoint_like
    raise AttributeError(name)
