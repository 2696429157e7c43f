"""Self-attention of the native decoder: grouped-query attention with rotary embeddings, the
masks (causal, sliding window, padding, packed documents), the KV cache, and the score
computation shared with the other attention kinds (:mod:`ckptkit.train.mla`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.features import SoftCapping
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.hybrid import HybridFields
from ckptkit.train.layers import RMSNorm
from ckptkit.train.rope import apply_rope


class KVCache:
    """Key/value cache for all layers of one generation batch, each layer's allocated for
    ``max_len`` tokens at its first update (in the shapes its attention gives)."""

    def __init__(
        self, cfg: ModelConfig, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.keys: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.length = 0  # tokens already stored (same for every layer)
        self.linear: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # linear attention: conv inputs, state
        self.max_len, self.device, self.dtype = max_len, device, dtype

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` (B, H_kv, T, D) at ``self.length``; return everything stored so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise CkptkitError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            keys = self.keys[layer] = k.new_zeros((*k.shape[:2], self.max_len, k.shape[3]), dtype=self.dtype)
            values = self.values[layer] = v.new_zeros((*v.shape[:2], self.max_len, v.shape[3]), dtype=self.dtype)
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]


def causal_mask(
    mask: torch.Tensor | None, past: int, T: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean SDPA mask (B or 1, 1, T, past + T), or None when plain ``is_causal`` suffices.

    Causal, limited to the last ``window`` keys (by index, like transformers) if set, and
    hiding padded keys (``mask`` (B, past + T), 1 for real tokens); a 4-D ``mask`` (packed
    documents) is used as given, windowed.
    """
    S = past + T
    window = window if window is not None and S > window else None
    if mask is not None and mask.dim() == 4:  # a full (B, 1, T, S) mask, e.g. packed documents
        if window is None:
            return mask.bool()
        q, k = torch.arange(past, S, device=device)[:, None], torch.arange(S, device=device)[None, :]
        return mask.bool() & (k > q - window)
    if mask is None and window is None and (past == 0 or T == 1):
        return None  # causal within the chunk (T > 1) or full attention to the cache (T == 1)
    q_idx = torch.arange(past, S, device=device)[:, None]
    k_idx = torch.arange(S, device=device)[None, :]
    out = k_idx <= q_idx
    if window is not None:
        out = out & (k_idx > q_idx - window)
    out = out[None, None]
    if mask is not None:
        out = out & mask[:, None, None, :S].bool()
        # Padding queries would attend to nothing (NaN in SDPA); let them see themselves.
        out = out | (k_idx == q_idx)
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    eager: bool = False,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for (B, H, T, D) queries and (B, H_kv, S, D) keys/values
    (grouped heads), causal when ``mask`` is None: SDPA, or transformers' eager arithmetic
    where scores are soft-capped, ``sinks`` (H,) add one learned logit per head to the
    softmax's denominator (gpt-oss; SDPA can do neither) or ``eager`` asks for it."""
    T = q.shape[2]
    if softcap is None and sinks is None and not eager:
        gqa = k.shape[1] != q.shape[1]
        is_causal = mask is None and T > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, scale=scale)
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    S = k.shape[2]
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    # the sink joins each row's logits, the row max is subtracted, and the sink's share is dropped
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Each KV head ``groups`` times (B, H_kv * groups, S, D), as transformers expands them: an
    expanded view, whose matmuls round as transformers' do (a copy's may not)."""
    if groups == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings; Qwen3-Next's and Qwen3.5's
    ``q_proj`` gives each head's query and then its output gate (``y * sigmoid(gate)``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.gated = cfg.feature(HybridFields) is not None
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        sinks = cfg.feature(GptOssFields) is not None  # gpt-oss: sinks, and a bias on the output too
        self.output_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=sinks)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if sinks else None
        decoder = cfg.decoder
        self.qk_norm = decoder.qk_norm
        if decoder.qk_norm:
            head = decoder.qk_norm == "head"
            q_dim = cfg.head_dim if head else cfg.num_heads * cfg.head_dim
            k_dim = cfg.head_dim if head else cfg.num_kv_heads * cfg.head_dim
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps, decoder.norm_plus_one)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps, decoder.norm_plus_one)
        caps = cfg.feature(SoftCapping)
        scalar = caps.query_pre_attn_scalar if caps else None
        self.scale = scalar**-0.5 if scalar else None
        self.softcap = caps.attn_logit_softcapping if caps else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.num_heads * self.head_dim)
        if self.qk_norm == "proj":  # OLMo 2: over the whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3, Gemma 3, GLM-4.5: per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        y = attend(q, k, v, mask, self.scale, self.softcap, self.sinks)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.output_proj(y if gate is None else y * torch.sigmoid(gate))
