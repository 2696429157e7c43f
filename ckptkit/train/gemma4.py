"""Gemma 4's decoder layer for the native model, as transformers' ``Gemma4TextModel`` runs it.

What it adds to Gemma 3's (:mod:`ckptkit.models.gemma4` lists the tensors):

- attention with heads of each layer's own size and KV head count, scale 1, q/k norms and a
  value norm without weight; with ``attention_k_eq_v`` the full layers' values are their keys'
  projection (normed as values); the last ``num_kv_shared_layers`` layers attend over the keys
  and values of the last earlier layer of their kind (:class:`Gemma4Attention`);
- per-layer inputs (PLE): a per-layer embedding of each token plus a projection of the
  embeddings (:class:`PerLayerInputs`), gated into each layer after its MLP;
- experts beside the dense MLP (``enable_moe_block``): a router on the RMS-normed residual
  (softmax, top k, renormalised, times a per-expert scale) and stacked GeGLU experts
  (:class:`Gemma4MoE`), each branch with norms of its own;
- each layer's output times its ``layer_scalar`` (a buffer, not trained).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.gemma4 import FULL, Gemma4Fields, layer_attention, layer_type, shares_kv
from ckptkit.train.attention import KVCache, attend
from ckptkit.train.layers import ACTIVATIONS, Carried, GatedMLP, RMSNorm, rms_normed
from ckptkit.train.rope import apply_rope

SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Layer kind -> the keys and values of the last layer of that kind that computed its own."""


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, scaled_in_float=True)


def full_head_dim(cfg: ModelConfig) -> int | None:
    """The head size of the full-attention layers (their rope's), None without any; one line
    for what the decoder does not run: full layers of several head sizes (transformers' rope is
    one per layer kind), bidirectional attention (``use_bidirectional_attention: all``)."""
    if cfg.fields(Gemma4Fields).use_bidirectional_attention == "all":
        raise CkptkitError(
            f"model type {cfg.model_type}: use_bidirectional_attention 'all' (not causal) is not run by the "
            "native decoder; it trains causal language models"
        )
    dims = {layer_attention(cfg, i)[0] for i in range(cfg.num_layers) if layer_type(cfg, i) == FULL}
    if len(dims) > 1:
        raise CkptkitError(f"model type {cfg.model_type}: full-attention layers of head sizes {sorted(dims)}")
    return dims.pop() if dims else None


class Gemma4Attention(nn.Module):
    """Self-attention of one Gemma 4 layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        f = cfg.fields(Gemma4Fields)
        self.layer_idx, self.kind, self.eps = layer_idx, layer_type(cfg, layer_idx), cfg.norm_eps
        self.head_dim, kv = layer_attention(cfg, layer_idx)
        self.num_heads, self.num_kv_heads = cfg.num_heads, kv
        self.shared = shares_kv(cfg, layer_idx)
        h, d, bias = cfg.hidden_size, self.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.q_norm = _norm(cfg, d)
        values = not (f.attention_k_eq_v and self.kind == FULL)
        if not self.shared:
            self.k_proj = nn.Linear(h, kv * d, bias=bias)
            self.k_norm = _norm(cfg, d)
            if values:
                self.v_proj = nn.Linear(h, kv * d, bias=bias)
        elif f.shared_kv_stored:  # Google's releases store them, transformers ignores them: carried
            stored = {"k_norm.scale": (d,), **{f"{p}.weight": (kv * d, h) for p in ("k_proj", "v_proj")[: 1 + values]}}
            stored |= {f"{p}.bias": (kv * d,) for p in ("k_proj", "v_proj")[: 1 + values] if bias}
            for name, module in Carried(stored).named_children():
                self.add_module(name, module)
        self.output_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        shared: SharedKV,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if self.shared:
            k, v = shared[self.kind]
        else:
            k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(k.shape) if hasattr(self, "v_proj") else k  # k_eq_v: the raw keys
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
            v = rms_normed(v, self.eps).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)
            shared[self.kind] = (k, v)
        y = attend(q, k, v, mask, scale=1.0, eager=True)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Gemma4Router(nn.Module):
    """Routes each token of the RMS-normed residual: ``weight @ (x * scale / sqrt(hidden))``,
    softmax in float32, top k renormalised, times the chosen experts' ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.fields(Gemma4Fields)
        experts = int(f.gemma4_experts or 0)
        self.top_k, self.eps, self.root = int(f.top_k_experts or 0), cfg.norm_eps, cfg.hidden_size**-0.5
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size))
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k), chosen experts (N, k)) for ``x`` (N, hidden)."""
        logits = F.linear(rms_normed(x, self.eps) * self.scale * self.root, self.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Experts(nn.Module):
    """Stacked experts as stored: ``gate_up_proj`` [E, 2I, hidden] (gate rows, then up rows),
    ``down_proj`` [E, hidden, I]; ``down(act(gate x) * up x)``, summed in index order."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.fields(Gemma4Fields)
        e, m, h = int(f.gemma4_experts or 0), int(f.gemma4_expert_size or 0), cfg.hidden_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * m, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, m))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            slot, token = torch.where((chosen == e).T)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class Gemma4MoE(nn.Module):
    """The experts beside the dense MLP; the experts chosen in the last forward in ``chosen``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Gemma4Router(cfg)
        self.experts = Gemma4Experts(cfg)
        self.chosen: torch.Tensor | None = None

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The experts' output for ``x`` (the normed residual), routed by ``residual``."""
        weights, chosen = self.router(residual.reshape(-1, residual.shape[-1]))
        self.chosen = chosen
        return self.experts(x.reshape(-1, x.shape[-1]), weights, chosen).reshape(x.shape)


class LayerInput(nn.Module):
    """A layer's use of its per-layer input: ``x + norm(proj(act(gate x) * input))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        p = cfg.fields(Gemma4Fields).hidden_size_per_layer_input
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate = nn.Linear(cfg.hidden_size, p, bias=False)
        self.proj = nn.Linear(p, cfg.hidden_size, bias=False)
        self.norm = _norm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.proj(self.act(self.gate(x)) * per_layer))


class PerLayerInputs(nn.Module):
    """Every layer's input (B, T, layers, p): ``(norm(model_proj(x) / sqrt(hidden)) +
    tok_embeddings(ids) * sqrt(p)) / sqrt(2)``, ``x`` the scaled token embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.fields(Gemma4Fields)
        self.layers, self.p = cfg.num_layers, f.hidden_size_per_layer_input
        rows = int(f.vocab_size_per_layer_input or cfg.vocab_size)
        self.tok_embeddings = nn.Embedding(rows, self.layers * self.p)
        self.model_proj = nn.Linear(cfg.hidden_size, self.layers * self.p, bias=False)
        self.norm = _norm(cfg, self.p)
        self.root = cfg.hidden_size**-0.5

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shape = (*input_ids.shape, self.layers, self.p)
        tokens = self.tok_embeddings(input_ids)
        tokens = (tokens * torch.tensor(self.p**0.5, dtype=tokens.dtype)).reshape(shape)
        projected = self.norm((self.model_proj(x) * self.root).reshape(shape))
        return (projected + tokens) * 2.0**-0.5


class Gemma4Block(nn.Module):
    """One Gemma 4 decoder layer: attention and MLP (with experts beside it) with norms before
    and after, then the per-layer input, all times ``layer_scalar``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        f, h = cfg.fields(Gemma4Fields), cfg.hidden_size
        self.sa_norm, self.attn_post_norm = _norm(cfg, h), _norm(cfg, h)
        self.mlp_norm, self.mlp_post_norm = _norm(cfg, h), _norm(cfg, h)
        self.attn = Gemma4Attention(cfg, layer_idx)
        wide = f.use_double_wide_mlp and shares_kv(cfg, layer_idx)
        self.mlp = GatedMLP(cfg, cfg.intermediate_size * (2 if wide else 1))
        self.moe = Gemma4MoE(cfg) if f.enable_moe_block else None
        if f.enable_moe_block:
            self.mlp_post_norm_1, self.moe_norm, self.moe_post_norm = _norm(cfg, h), _norm(cfg, h), _norm(cfg, h)
        self.ple = LayerInput(cfg) if f.hidden_size_per_layer_input else None
        self.layer_scalar: torch.Tensor
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        per_layer: torch.Tensor | None,
        shared: SharedKV,
    ) -> torch.Tensor:
        x = x + self.attn_post_norm(self.attn(self.sa_norm(x), cos, sin, mask, cache, shared))
        m = self.mlp(self.mlp_norm(x))
        if self.moe is not None:
            m = self.mlp_post_norm_1(m) + self.moe_post_norm(self.moe(x, self.moe_norm(x)))
        x = x + self.mlp_post_norm(m)
        if self.ple is not None and per_layer is not None:
            x = self.ple(x, per_layer)
        return x * self.layer_scalar
