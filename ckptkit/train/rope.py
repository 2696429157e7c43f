"""Rotary position embeddings of the native decoder, computed in float32 as transformers does:
the inverse frequencies (Llama 3 and YaRN scaling, partial rotary, a local base), the cos/sin tables,
Gemma 4's proportional rope, and the two ways of rotating (halves, HF's layout; interleaved pairs, DeepSeek's)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.features import LocalRope, PartialRotary
from ckptkit.models.hybrid import HybridFields


def local_theta(cfg: ModelConfig) -> float | None:
    """The rope base of the sliding-window layers when they have their own (Gemma 3)."""
    local = cfg.feature(LocalRope)
    return local.local_rope_theta if local else None


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", scaling and scaling.get("type")) or "default"


def rope_inv_freq(cfg: ModelConfig, local: bool = False, head_dim: int | None = None) -> torch.Tensor:
    """Inverse rotary frequencies (float32), with Llama 3, YaRN or proportional scaling if
    configured; ``local``: those of sliding-window layers with their own base (``local_rope_theta``,
    unscaled); ``head_dim``: the heads' size where it is not ``cfg.head_dim`` (Gemma 4's full layers)."""
    head_dim = head_dim or cfg.head_dim
    partial = cfg.feature(PartialRotary) or cfg.feature(HybridFields)  # Qwen3.5's mRoPE: plain rope on text
    dim = int(head_dim * (partial.partial_rotary_factor if partial else 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    own = local_theta(cfg) if local else None
    theta = own or cfg.rope_theta
    inv_freq = 1.0 / (theta**exponents)
    scaling = None if local else cfg.rope_scaling
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if scaling is not None and rope_type == "yarn":
        return _yarn(cfg, scaling, theta, dim)
    if scaling is not None and rope_type == "proportional":
        return _proportional(scaling, theta, head_dim)
    if rope_type != "llama3" or scaling is None:
        raise CkptkitError(f"rope scaling type {rope_type!r} is not supported by the native model")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(cfg: ModelConfig, scaling: dict[str, Any]) -> float:
    return scaling.get("factor") or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]


def _yarn(cfg: ModelConfig, scaling: dict[str, Any], theta: float, dim: int) -> torch.Tensor:
    """YaRN: each frequency between its interpolated (``/ factor``) and original value by a
    linear ramp over the dims between ``beta_fast`` and ``beta_slow`` rotations."""
    factor = _yarn_factor(cfg, scaling)
    old_len = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _proportional(scaling: dict[str, Any], theta: float, head_dim: int) -> torch.Tensor:
    """Gemma 4's proportional rope: the first ``partial_rotary_factor`` of the frequency pairs
    with exponents over the whole head (``i / head_dim``), the rest zero (not rotated), all
    divided by ``factor``; rotated in halves over the whole head."""
    angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, device="cpu")))
    return inv_freq / scaling.get("factor", 1.0)


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """The factor YaRN scales cos and sin by (1.0 for every other rope)."""
    scaling = None if local else cfg.rope_scaling
    if scaling is None or _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = _yarn_factor(cfg, scaling), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor)


def yarn_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's attention-scale correction (``mscale_all_dim``) under a scaled rope; 1.0 otherwise."""
    all_dim = (scaling or {}).get("mscale_all_dim")
    if scaling is None or _rope_type(scaling) == "default" or not all_dim:
        return 1.0
    return _mscale(scaling["factor"], all_dim)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary (per-row) position ids, computed in float32."""

    def __init__(self, cfg: ModelConfig, local: bool = False, head_dim: int | None = None) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round it.
        self.inv_freq = rope_inv_freq(cfg, local, head_dim)
        self.factor = rope_attention_factor(cfg, local)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, rot_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.factor == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D); only the first ``cos.shape[-1]`` dims (partial rotary)."""
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) whose pairs are interleaved ``(x0, x1), (x2, x3)...`` (DeepSeek);
    the result is in halves layout (evens rotated, then odds), as transformers returns it."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) whose pairs are interleaved ``(x0, x1), (x2, x3)...`` and keep
    them so (Llama 4's complex layout), in float32 as transformers multiplies complex numbers."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half].float(), sin[:, None, :, :half].float()
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)
