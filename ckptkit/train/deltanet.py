"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5, in plain PyTorch with the
arithmetic of transformers' torch path: input projections (Qwen3-Next's fused ``in_proj_qkvz`` /
``in_proj_ba`` grouped per key head, or Qwen3.5's ``in_proj_qkv`` / ``z`` / ``b`` / ``a``), a
causal depthwise convolution with SiLU over queries, keys and values, the gated delta rule
computed chunk by chunk (64 tokens: within a chunk by a unit-triangular solve, across chunks
by a recurrent state of ``key_dim x value_dim`` per value head), and a gated RMSNorm
(``scale * norm(x) * silu(z)``, the scale stored as is, not minus one) before ``out_proj``.

Padded tokens are zeroed at the input, as transformers does; the documents of a packed row
are run one by one, so no state or convolution window crosses from one into the next. With a
:class:`~ckptkit.train.attention.KVCache`, each layer keeps its last convolution inputs and its
recurrent state there, so generation continues from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.models.config import ModelConfig
from ckptkit.models.hybrid import HybridFields

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA library's rule)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``q``, ``k`` (B, T, H_k, D_k), ``v`` (B, T, H_v, D_v), the log
    decay ``g`` and the write strength ``beta`` (B, T, H_v), in float32: the output (B, T, H_v,
    D_v) in ``q``'s dtype and the final state (B, H_v, D_k, D_v). Queries and keys are
    L2-normalised, queries scaled by ``D_k ** -0.5``; each key head serves consecutive value heads."""
    dtype = q.dtype
    B, T, heads_k, dim_k = k.shape
    heads_v, dim_v = v.shape[-2:]
    if heads_v != heads_k:
        q, k = (t.repeat_interleave(heads_v // heads_k, dim=2) for t in (q, k))
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))  # fmt: skip
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * dim_k**-0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(B, heads_v, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    decay = g.reshape(B, heads_v, n, chunk).cumsum(dim=-1)  # log of the decay from the chunk's start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * between  # strictly lower part: I + L (unit diagonal)
    inner = (q @ k.transpose(-1, -2)) * between
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    s = torch.zeros(B, heads_v, dim_k, dim_v, dtype=values.dtype, device=values.device)
    s = s if state is None else state.to(values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    last = decay[..., -1].exp()[..., None, None]
    out = []
    for i in range(n):
        fresh = values[:, :, i] - keys[:, :, i] @ s  # what the state does not predict yet
        out.append(q[:, :, i] @ s + inner[:, :, i] @ fresh)
        s = s * last[:, :, i] + k[:, :, i].transpose(-1, -2) @ fresh
    y = torch.stack(out, dim=2).reshape(B, heads_v, -1, dim_v)[:, :, :T]
    return y.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``x`` in float32, times ``scale`` in ``x``'s dtype, times ``silu(gate)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.scale * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; canonical names ``linear_attn.in_proj_qkvz`` (or ``in_proj_qkv``,
    ``_z``, ``_b``, ``_a``), ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, split: bool) -> None:
        super().__init__()
        f = cfg.fields(HybridFields)
        h = cfg.hidden_size
        self.layer_idx, self.split = layer_idx, split
        self.heads_k, self.heads_v = f.linear_num_key_heads, f.linear_num_value_heads
        self.dim_k, self.dim_v = f.linear_key_head_dim, f.linear_value_head_dim
        self.key_dim, self.value_dim = self.heads_k * self.dim_k, self.heads_v * self.dim_v
        channels = 2 * self.key_dim + self.value_dim
        self.kernel = f.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)
        if split:
            self.in_proj_qkv = nn.Linear(h, channels, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.heads_v, bias=False)
            self.in_proj_a = nn.Linear(h, self.heads_v, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(h, channels + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.heads_v, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.heads_v))
        self.A_log = nn.Parameter(torch.zeros(self.heads_v))
        self.norm = GatedRMSNorm(self.dim_v, cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed q|k|v (B, T, channels), z (B, T, H_v, D_v), b, a (B, T, H_v))."""
        B, T, _ = x.shape
        if self.split:
            z = self.in_proj_z(x).reshape(B, T, self.heads_v, self.dim_v)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        per = self.heads_v // self.heads_k  # value heads per key head: Qwen3-Next groups by key head
        qkvz = self.in_proj_qkvz(x).view(B, T, self.heads_k, 2 * self.dim_k + 2 * per * self.dim_v)
        q, k, v, z = torch.split(qkvz, [self.dim_k, self.dim_k, per * self.dim_v, per * self.dim_v], dim=3)
        b, a = torch.split(self.in_proj_ba(x).view(B, T, self.heads_k, 2 * per), [per, per], dim=3)
        mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(B, T, self.heads_v, self.dim_v), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def _documents(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One packed row (1, T, hidden), each document (where a token cannot see the one
        before it, a new one starts) run on its own."""
        T = x.shape[1]
        starts = [0, *(t for t in range(1, T) if not bool(mask[t, t - 1])), T]
        return torch.cat([self.forward(x[:, a:b]) for a, b in zip(starts, starts[1:], strict=False)], dim=1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None, states: dict | None = None) -> torch.Tensor:
        """``x`` (B, T, hidden); ``pad`` (B, T), 0 at padded tokens, or a packed batch's block-causal
        document mask (B, 1, T, T); ``states``: a cache's per-layer (convolution inputs,
        recurrent state), read and updated."""
        if pad is not None and pad.dim() == 4:
            return torch.cat([self._documents(x[b : b + 1], pad[b, 0]) for b in range(x.shape[0])])
        if pad is not None:
            x = (x * pad[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        mixed, z, b, a = self._project(x)
        mixed = mixed.transpose(1, 2)
        held = states.get(self.layer_idx) if states is not None else None
        window = held[0] if held is not None else mixed.new_zeros(B, mixed.shape[1], self.kernel - 1)
        full = torch.cat([window, mixed], dim=-1).to(self.conv1d.weight.dtype)
        mixed = F.silu(F.conv1d(full, self.conv1d.weight, groups=full.shape[1])).to(x.dtype).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, T, self.heads_k, self.dim_k), k.reshape(B, T, self.heads_k, self.dim_k)
        v = v.reshape(B, T, self.heads_v, self.dim_v)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        y, state = chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), held[1] if held is not None else None)
        if states is not None:
            states[self.layer_idx] = (full[:, :, full.shape[-1] - (self.kernel - 1) :].detach(), state.detach())
        y = self.norm(y.reshape(-1, self.dim_v), z.reshape(-1, self.dim_v))
        return self.out_proj(y.reshape(B, T, self.value_dim))
