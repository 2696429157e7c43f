"""The native decoder's small building blocks: RMSNorm, the gated MLP and its activations, and
the tensors it carries without running them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; Gemma's variant scales by ``1 + scale``, Gemma 4's
    (``scaled_in_float``) by ``scale`` in float32 before the cast."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, scaled_in_float: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one, self.scaled_in_float = plus_one, scaled_in_float
        self.scale = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.plus_one:  # Gemma: (x * (1 + w)) in float32, then cast
            return (normed * (1.0 + self.scale.float())).type_as(x)
        if self.scaled_in_float:  # Gemma 4: (x * w) in float32, then cast
            return (normed * self.scale.float()).type_as(x)
        return self.scale * normed.type_as(x)  # Llama: cast, then x * w


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a scale, in float32, cast back (Gemma 4's value norm and router input)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class Carried(nn.Module):
    """Tensors a checkpoint holds that the decoder does not run (the MTP layers of DeepSeek,
    GLM, Qwen3-Next and Qwen3.5; Qwen3.5's vision tower; Gemma 4's vision and audio towers and
    the k/v its releases store for KV-shared layers), as buffers under their canonical names:
    loaded, never trained, saved back as read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            module: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, torch.empty(shape))


class GatedMLP(nn.Module):
    """SwiGLU / GeGLU feed-forward: ``w2(act(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig, size: int | None = None) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise CkptkitError(f"activation {cfg.hidden_act!r} is not supported by the native model")
        self.act = ACTIVATIONS[cfg.hidden_act]
        size = size or cfg.intermediate_size
        self.w1 = nn.Linear(cfg.hidden_size, size, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden_size, size, bias=False)  # up
        self.w2 = nn.Linear(size, cfg.hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of interleaved gate/up columns (gate first): gate clamped above at
    ``limit``, up to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
