"""The router's load-balancing loss of mixture-of-experts models, as transformers computes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func``
    computes it: ``E * sum(fraction of top-k assignments per expert * mean routing
    probability)`` over the tokens of every layer, padding (``attention_mask`` 0) left out.

    ``reduce`` (sums a tensor over ranks in place) makes it the loss of every rank's tokens
    together, as one device computes it on the whole batch; its gradient is then this rank's
    share (the other ranks' routing enters as constants).
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, device=device)
    prob_sum = torch.zeros(num_experts, device=device)
    rows = torch.zeros((), device=device)
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        weight = (
            torch.ones(probs.shape[0], device=device) if attention_mask is None else attention_mask.reshape(-1).float()
        )
        counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    if reduce is not None:
        local = torch.cat([counts, prob_sum.detach(), rows[None]])
        total = local.clone()
        reduce(total)
        counts, rows = total[:num_experts], total[-1]
        prob_sum = prob_sum + (total[num_experts:-1] - local[num_experts:-1])
    return (counts / rows * prob_sum / rows).sum() * num_experts
