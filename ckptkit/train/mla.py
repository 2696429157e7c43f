"""Multi-head latent attention (DeepSeek V2/V3): queries through a low-rank ``q_a_proj`` /
``q_a_norm`` / ``q_b_proj`` (or one ``q_proj``), keys and values from one latent
(``kv_a_proj``: ``kv_lora_rank`` latent dims plus one rotary key shared by every head,
``kv_a_norm``, then ``kv_b_proj`` per head), rope on the last ``qk_rope_head_dim`` dims of
each query and on the shared key (interleaved pairs with ``rope_interleave``), as
transformers computes it. The cache keeps the latents, not the expanded keys and values."""

from __future__ import annotations

import torch
from torch import nn

from ckptkit.models.config import ModelConfig
from ckptkit.models.deepseek_v3 import DeepseekV3Fields
from ckptkit.train.attention import KVCache, attend
from ckptkit.train.layers import RMSNorm
from ckptkit.train.rope import apply_rope, apply_rope_interleaved, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: the config's eps is not used


class LatentAttention(nn.Module):
    """DeepSeek V3's attention; canonical names ``attn.q_a_proj``, ``attn.kv_b_proj``..."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        f = cfg.fields(DeepseekV3Fields)
        self.layer_idx, self.num_heads = layer_idx, cfg.num_heads
        self.nope, self.rope, self.v_dim = f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim
        self.rank = f.kv_lora_rank
        self.interleaved = f.rope_interleave
        h, bias, qk = cfg.hidden_size, cfg.attention_bias, f.qk_nope_head_dim + f.qk_rope_head_dim
        self.q_proj: nn.Linear | None = None
        if f.q_lora_rank:
            self.q_a_proj = nn.Linear(h, f.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(f.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(f.q_lora_rank, cfg.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, cfg.num_heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(h, f.kv_lora_rank + f.qk_rope_head_dim, bias=bias)
        self.kv_a_norm = RMSNorm(f.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(f.kv_lora_rank, cfg.num_heads * (f.qk_nope_head_dim + f.v_head_dim), bias=False)
        self.output_proj = nn.Linear(cfg.num_heads * f.v_head_dim, h, bias=False)
        self.scale = qk**-0.5 * yarn_mscale(cfg.rope_scaling) ** 2

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(B, T, self.num_heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent).view(B, 1, T, self.rank)
        k_rot = k_rot.view(B, 1, T, self.rope)
        rotate = apply_rope_interleaved if self.interleaved else apply_rope
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)
        if cache is not None:
            latent, k_rot = cache.update(self.layer_idx, latent, k_rot)
        S = latent.shape[2]
        kv = self.kv_b_proj(latent).view(B, S, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        y = attend(torch.cat((q_pass, q_rot), dim=-1), k, v, mask, self.scale)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim))
