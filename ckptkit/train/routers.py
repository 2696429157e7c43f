"""How a mixture-of-experts layer picks each token's experts and weights from its router logits,
as transformers routes them (ties broken as ``torch.topk`` breaks them):

- :class:`SoftmaxTopK` (Mixtral, Qwen3-MoE): softmax in float32, top k, optionally
  renormalised, the weights in the logits' dtype;
- :class:`GroupedSigmoidTopK` (DeepSeek V3, GLM-4.5): sigmoid scores, plus the router's
  ``expert_bias`` (``e_score_correction_bias``) for the choice only; experts in groups, of
  which the ``topk_group`` with the best two-expert sums compete; the weights are the chosen
  unbiased scores, optionally renormalised, times ``routed_scaling_factor``, in float32;
- :class:`TopKSoftmax` (gpt-oss): the top k logits, then a softmax over those k alone, in the
  logits' dtype;
- :class:`TopKSigmoid` (Llama 4): the top k logits, each weighted by its sigmoid (in float32,
  cast back to the logits' dtype); Llama 4 scales the experts' inputs by these weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ckptkit.models.config import ModelConfig
from ckptkit.models.deepseek_v3 import SharedExpertsFields
from ckptkit.models.moe import MoEFields

Routed = tuple[torch.Tensor, torch.Tensor]
"""(weights (N, k), chosen experts (N, k)) for N tokens."""


class SoftmaxTopK:
    """The top ``k`` experts by softmax probability."""

    def __init__(self, moe: MoEFields) -> None:
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob

    def __call__(self, logits: torch.Tensor, expert_bias: torch.Tensor | None) -> Routed:
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen


class GroupedSigmoidTopK:
    """The top ``k`` experts by biased sigmoid score among the best ``topk_group`` groups."""

    def __init__(self, moe: SharedExpertsFields) -> None:
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.groups, self.topk_group, self.scale = moe.n_group, moe.topk_group, moe.routed_scaling_factor

    def __call__(self, logits: torch.Tensor, expert_bias: torch.Tensor | None) -> Routed:
        assert expert_bias is not None
        scores = logits.float().sigmoid()
        choice = scores + expert_bias.float()
        n, experts = choice.shape
        grouped = choice.view(n, self.groups, experts // self.groups)
        best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros(n, self.groups, dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // self.groups, dim=1), float("-inf"))
        chosen = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, chosen


class TopKSoftmax:
    """The top ``k`` experts by logit, weighted by a softmax over the chosen logits."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def __call__(self, logits: torch.Tensor, expert_bias: torch.Tensor | None) -> Routed:
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), chosen


class TopKSigmoid:
    """The top ``k`` experts by logit, each weighted by the sigmoid of its logit."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def __call__(self, logits: torch.Tensor, expert_bias: torch.Tensor | None) -> Routed:
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return top.float().sigmoid().to(logits.dtype), chosen


def routing(cfg: ModelConfig) -> SoftmaxTopK | GroupedSigmoidTopK:
    """The routing rule of ``cfg``'s experts."""
    grouped = cfg.feature(SharedExpertsFields)
    return GroupedSigmoidTopK(grouped) if grouped is not None else SoftmaxTopK(cfg.fields(MoEFields))


def has_expert_bias(cfg: ModelConfig) -> bool:
    """Whether the router carries a bias for the choice of experts (``mlp.router.expert_bias``)."""
    return cfg.feature(SharedExpertsFields) is not None
