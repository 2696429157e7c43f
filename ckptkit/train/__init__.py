"""ckptkit's native-PyTorch trainer: one decoder for every model type, LoRA, PEFT adapters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptkit.train.transformer import Transformer, build_model, load_model

__all__ = ["Transformer", "build_model", "load_model"]


def __getattr__(name: str) -> Any:  # import torch only when the model is used
    if name in __all__:
        from ckptkit.train import transformer

        return getattr(transformer, name)
    raise AttributeError(name)
