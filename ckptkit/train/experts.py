"""The mixture-of-experts MLP of the native decoder: a router (a linear layer, LoRA-adaptable,
with its choice bias as a buffer where the family has one), the routing rule of
:mod:`ckptkit.train.routers`, experts summed in index order as transformers sums them, and
the shared experts every token goes through (DeepSeek V3, GLM-4.5; Qwen3-Next's and Qwen3.5's
one behind a sigmoid gate); and gpt-oss's experts, stacked tensors with biases and a clamped
SwiGLU (:class:`StackedMoE`); and Llama 4's, stacked without biases, a shared expert beside them
(:class:`Llama4MoE`)."""

from __future__ import annotations

import torch
from torch import nn

from ckptkit.models.config import ModelConfig
from ckptkit.models.deepseek_v3 import SharedExpertsFields
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.hybrid import HybridFields
from ckptkit.models.moe import MoEFields, expert_size
from ckptkit.train.layers import ACTIVATIONS, GatedMLP, clamped_swiglu
from ckptkit.train.routers import TopKSigmoid, TopKSoftmax, has_expert_bias, routing
from ckptkit.train.stacked_lora import weight


class SparseMoE(nn.Module):
    """Top-k routed experts (and shared ones). The router logits of the last forward are kept
    in ``router_logits`` (the aux loss), the experts chosen in ``chosen``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.fields(MoEFields)
        self.top_k = moe.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        if has_expert_bias(cfg):  # not trained (DeepSeek balances it by a rule of its own)
            self.router.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        self.route = routing(cfg)
        self.experts = nn.ModuleList(GatedMLP(cfg, expert_size(cfg)) for _ in range(moe.num_experts))
        shared = cfg.feature(SharedExpertsFields)
        n_shared = shared.n_shared_experts if shared is not None else 0
        self.shared = GatedMLP(cfg, expert_size(cfg) * n_shared) if n_shared else None
        hybrid = cfg.feature(HybridFields)  # Qwen3-Next, Qwen3.5: one shared expert, scaled by a sigmoid gate
        self.shared_gate = None
        if hybrid is not None and hybrid.shared_expert_intermediate_size:
            self.shared = GatedMLP(cfg, hybrid.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.router_logits: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        weights, chosen = self.route(logits, getattr(self.router, "expert_bias", None))
        self.router_logits, self.chosen = logits, chosen
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # also on no tokens: every expert gets a
            slot, token = torch.where((chosen == e).T)  # gradient (zero), as FSDP reduces them together
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        out = out.reshape(shape)
        if self.shared is None:
            return out
        shared = self.shared(x)
        return out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)


class StackedExperts(nn.Module):
    """gpt-oss's experts as stored: ``gate_up_proj`` [E, hidden, 2I] (gate and up columns
    interleaved), ``down_proj`` [E, I, hidden], each with a bias; ``x @ W + b`` per expert
    (LoRA-adaptable, :mod:`ckptkit.train.stacked_lora`)."""

    transposed = True  # [E, in, out], as transformers marks it (PEFT's LoRA follows)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.fields(GptOssFields)
        e, h, inter = f.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.alpha, self.limit = f.swiglu_alpha, f.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(e, inter, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``x`` (N, hidden) through each token's ``chosen`` experts (N, k), summed by ``weights``."""
        out = torch.zeros_like(x)
        gate_up, down = weight(self, "gate_up_proj"), weight(self, "down_proj")
        for e in range(gate_up.shape[0]):  # every expert, in index order as transformers sums
            slot, token = torch.where((chosen == e).T)
            gated = clamped_swiglu(x[token] @ gate_up[e] + self.gate_up_proj_bias[e], self.alpha, self.limit)
            y = (gated @ down[e] + self.down_proj_bias[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class StackedMoE(nn.Module):
    """gpt-oss's MoE MLP: a router with a bias (top k, softmax over them) and
    :class:`StackedExperts`; the experts chosen in the last forward are kept in ``chosen``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = cfg.fields(GptOssFields)
        self.router = nn.Linear(cfg.hidden_size, f.num_local_experts, bias=True)
        self.route = TopKSoftmax(f.num_experts_per_tok)
        self.experts = StackedExperts(cfg)
        self.chosen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(self.router(flat), None)
        self.chosen = chosen
        return self.experts(flat, weights, chosen).reshape(x.shape)


class FusedExperts(nn.Module):
    """Llama 4's experts as stored: ``gate_up_proj`` [E, hidden, 2I] (gate columns, then up),
    ``down_proj`` [E, I, hidden], no biases; ``x @ W`` per expert, the router's weight applied
    to each expert's input, not its output (LoRA-adaptable, :mod:`ckptkit.train.stacked_lora`)."""

    transposed = False  # transformers does not mark it [E, in, out]: PEFT's LoRA swaps in and out

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, inter = cfg.fields(MoEFields).num_experts, cfg.hidden_size, cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(e, inter, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``x`` (N, hidden), each token scaled by its ``chosen`` experts' (N, k) ``weights``
        and through them, summed."""
        out = torch.zeros_like(x)
        gate_up, down = weight(self, "gate_up_proj"), weight(self, "down_proj")
        for e in range(gate_up.shape[0]):  # every expert, in index order as transformers sums
            slot, token = torch.where((chosen == e).T)
            gate, up = ((x[token] * weights[token, slot, None]) @ gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, token, (up * self.act(gate)) @ down[e])
        return out


class Llama4MoE(nn.Module):
    """Llama 4's MoE MLP: a router (top k, sigmoid weights), :class:`FusedExperts` and a shared
    expert every token goes through; router logits and choice of the last forward are kept."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.fields(MoEFields)
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.route = TopKSigmoid(moe.num_experts_per_tok)
        self.experts = FusedExperts(cfg)
        self.shared = GatedMLP(cfg)
        self.router_logits: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weights, chosen = self.route(logits, None)
        self.router_logits, self.chosen = logits, chosen
        return (self.shared(flat) + self.experts(flat, weights, chosen)).reshape(x.shape)
