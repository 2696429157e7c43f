"""The parts of a training step: token-weighted loss, evaluation, optimizer, schedule, compile.

Gradient accumulation weighs every label token equally across the micro-batches of an
optimizer step (the loss is the sum over tokens divided by the step's token count), so
``gradient_accumulation_steps`` micro-batches give the update of one batch that large,
however the tokens are spread over the micro-batches and their padding. On several ranks
each rank sums the token losses of its part of every global batch and divides by the
global batch's token count (times the ranks FSDP averages gradients over), which gives the
single-device gradient.

A mixture-of-experts model adds the router's load-balancing loss of each global batch
(over every rank's tokens, padding left out, as transformers computes it), times
``router_aux_loss_coef``, averaged over the step's global batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig
from ckptkit.models.gemma4 import Gemma4Fields
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.llama4 import Llama4Fields
from ckptkit.models.moe import experts
from ckptkit.train.data import TokenizedDataset, collate
from ckptkit.train.lora import decoder_layers
from ckptkit.train.samples import IGNORE_INDEX, Sample
from ckptkit.train.schema import OptimizerConfig, SchedulerConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The config's dtype names (``dtype``, ``mixed_precision.*``) as torch dtypes."""

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor over all ranks in place (nothing on one device)."""


@dataclass
class StepStats:
    """One step's loss (mean per label token, plus the weighted aux loss of a model with
    experts), its label tokens and input tokens (padding excluded), and the unweighted aux
    loss (mean over the step's global batches; None without one)."""

    loss: float
    label_tokens: int
    input_tokens: int
    aux_loss: float | None = None


def router_aux_weight(coef: float | None, model: ModelConfig) -> float:
    """The weight of the router's load-balancing loss: ``coef`` (the recipe's
    ``router_aux_loss_coef``), else the model's own (``config.json``); 0 without experts."""
    moe = experts(model)
    gemma4 = model.feature(Gemma4Fields)
    stacked = model.feature(GptOssFields) is not None or model.feature(Llama4Fields) is not None
    if stacked or (gemma4 is not None and gemma4.enable_moe_block):
        if coef:  # (transformers' Llama4ForCausalLM adds none: its config's coefficient is unused)
            raise CkptkitError(
                f"router_aux_loss_coef: the load-balancing loss of {model.model_type}'s router is not supported yet; "
                "remove router_aux_loss_coef"
            )
        return 0.0
    if moe is None:
        if coef:
            raise CkptkitError(
                f"router_aux_loss_coef applies to mixture-of-experts models; {model.model_type} has no experts"
            )
        return 0.0
    return moe.router_aux_loss_coef if coef is None else coef


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The model's keyword arguments for a collated batch (packed batches: document mask and positions)."""
    mask = batch.get("document_mask", batch["attention_mask"])
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch.get("position_ids")}


def summed_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the batch's label tokens (float32 logits)."""
    logits = model(**model_inputs(batch))
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def label_tokens(samples: Sequence[Sample]) -> int:
    """The label tokens (positions with a loss) of these samples once collated."""
    return sum(t != IGNORE_INDEX for s in samples for t in s.labels[1:])


def forward_backward(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    step_tokens: int | None = None,
    world_size: int = 1,
    reduce: Reduce | None = None,
    aux_weight: float = 0.0,
) -> StepStats:
    """Accumulate the gradient of the step's token-mean loss over ``batches`` (no optimizer step).

    On several ranks ``batches`` are this rank's parts of the step's global batches,
    ``step_tokens`` the label tokens of the whole global batches and ``reduce`` sums over
    ranks; the loss returned is the global one. ``aux_weight``: the weight of the router's
    load-balancing loss (:func:`router_aux_weight`).
    """
    if step_tokens is None:
        step_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    count = max(step_tokens, 1)
    total = torch.zeros((), device=device)
    aux_total: torch.Tensor | None = None
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = summed_loss(model, batch)
        scaled = loss / count
        if aux_weight:  # the same value on every rank, each rank's share of the gradient
            aux = model.aux_loss(batch["attention_mask"], reduce)  # type: ignore[operator]
            if aux is not None:
                scaled = scaled + aux * (aux_weight / len(batches))
                aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
        (scaled * world_size if world_size != 1 else scaled).backward()  # FSDP averages gradients over ranks
        total += loss.detach()
    if reduce is not None:
        reduce(total)
    input_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    if aux_total is None:
        return StepStats((total / count).item(), step_tokens, input_tokens)
    aux_mean = (aux_total / len(batches)).item()
    return StepStats((total / count).item() + aux_weight * aux_mean, step_tokens, input_tokens, aux_mean)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: TokenizedDataset,
    batch_size: int,
    pad_id: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    reduce: Reduce | None = None,
) -> float:
    """Mean loss per label token over the whole ``dataset`` (eval mode: no dropout, no gradient).

    On several ranks each global batch (``batch_size`` per rank) is split as in training and
    every rank runs as many forwards as the others (a rank without samples in the last
    batch runs one whose loss it drops), since FSDP's forward is a collective.
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    step = batch_size * world_size
    for start in range(0, len(dataset), step):
        indices = list(range(start, min(start + step, len(dataset))))[rank::world_size]
        batch = collate([dataset[i] for i in indices or [0]], pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = summed_loss(model, batch).item()
        if indices:
            total += loss
            tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    if reduce is not None:
        sums = torch.tensor([total, tokens], dtype=torch.float64, device=device)
        reduce(sums)
        total, tokens = sums[0].item(), int(sums[1].item())
    return total / max(tokens, 1)


def build_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW from the ``optimizer`` section; the fused kernel by default on CPU and CUDA.

    ``optimizer.fused``: null (default) picks fused where torch has it for the device (CPU,
    CUDA); false leaves the choice to torch (for-each on CUDA, the for-loop on CPU, where
    bench/optimizer.py measured for-each slower than it); true forces fused.
    """
    fused = cfg.fused
    if fused is None:
        fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(
        params, lr=float(cfg.lr), betas=(cfg.betas[0], cfg.betas[1]), weight_decay=float(cfg.weight_decay), fused=fused
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder block in place (parameter names unchanged)."""
    for layer in decoder_layers(model):
        layer.compile()


def compiled_layers(model: nn.Module) -> int:
    """How many decoder blocks run compiled."""
    return sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))
