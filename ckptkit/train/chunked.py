"""Llama 4's attention: rope on interleaved pairs (its complex layout) in the rope layers, with
weightless L2 norms of queries and keys after it (``use_qk_norm``); in the NoPE layers no rope
and queries scaled by a temperature that grows with the position (``attn_temperature_tuning``:
``1 + attn_scale * log(1 + floor((pos + 1) / floor_scale))``); and the rope layers' attention
limited to the keys of the query's chunk of ``attention_chunk_size`` positions.

Chunks and temperature go by each token's position (``position_ids``), as transformers' chunk
masks do; transformers' temperature goes by the token's index, which differs only in
left-padded rows (there the position is the one the row has unpadded, so a row's logits do not
depend on its padding) and keeps packed documents apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.models.config import ModelConfig
from ckptkit.models.llama4 import Llama4Fields
from ckptkit.train.attention import Attention, KVCache, attend
from ckptkit.train.rope import apply_rope_pairs


def key_positions(
    mask: torch.Tensor | None, past: int, position_ids: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The positions (B or 1, past + T) of the keys a query sees: the queries' own without a
    cache, else counted from the padding ``mask`` (B, past + T) as the decoder counts them."""
    if past == 0:
        return position_ids
    if mask is not None and mask.dim() == 2:
        return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, : past + position_ids.shape[1]]
    return torch.arange(past + position_ids.shape[1], device=device)[None]


def chunked_mask(
    causal: torch.Tensor | None,
    mask: torch.Tensor | None,
    past: int,
    position_ids: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """``causal`` (the boolean mask of :func:`~ckptkit.train.attention.causal_mask`, None:
    plain causal) limited to keys whose position lies in the query's chunk of ``chunk``."""
    T = position_ids.shape[1]
    keys = key_positions(mask, past, position_ids, position_ids.device)
    same = (position_ids[:, :, None] // chunk) == (keys[:, None, :] // chunk)
    if causal is None:
        S = past + T
        causal = torch.ones(T, S, dtype=torch.bool, device=position_ids.device).tril(past)[None, None]
    return causal & same[:, None]


def temperature(position_ids: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """The NoPE layers' query scale (B, T), float32."""
    return torch.log1p(torch.floor((position_ids.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class ChunkedAttention(Attention):
    """Llama 4's grouped-query attention (its rope, L2 norms and temperature; the chunked mask
    comes with the layer's ``mask``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        f = cfg.fields(Llama4Fields)
        self.rope = f.uses_rope(layer_idx)
        self.l2_eps = cfg.norm_eps if f.use_qk_norm and self.rope else None
        self.temperature = (f.floor_scale, f.attn_scale) if f.attn_temperature_tuning and not self.rope else None
        if cfg.attention_bias:  # on the output projection too
            self.output_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        if self.l2_eps is not None:
            q = F.rms_norm(q.float(), (self.head_dim,), eps=self.l2_eps).type_as(q)
            k = F.rms_norm(k.float(), (self.head_dim,), eps=self.l2_eps).type_as(k)
        if self.temperature is not None:
            assert positions is not None
            q = (q * temperature(positions, *self.temperature)[:, None, :, None]).to(q.dtype)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        y = attend(q, k, v, mask, self.scale, self.softcap, self.sinks)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
