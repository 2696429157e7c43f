"""The parts of a training step both recipes share: token-weighted loss, evaluation, optimizer, compile.

Gradient accumulation weighs every label token equally across the micro-batches of an
optimizer step (the loss is the sum over tokens divided by the step's token count), so
``gradient_accumulation_steps`` micro-batches give the update of one batch that large,
however the tokens are spread over the micro-batches and their padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.train.data import IGNORE_INDEX, TokenizedDataset, collate


@dataclass
class StepStats:
    """One step's mean loss per label token, its label tokens and input tokens (padding excluded)."""

    loss: float
    label_tokens: int
    input_tokens: int


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


def forward_backward(model: nn.Module, batches: list[dict[str, torch.Tensor]], device: torch.device) -> StepStats:
    """Accumulate the gradient of the step's token-mean loss over ``batches`` (no optimizer step)."""
    label_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = summed_loss(model, batch)
        (loss / max(label_tokens, 1)).backward()
        total += loss.detach()
    input_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return StepStats((total / max(label_tokens, 1)).item(), label_tokens, input_tokens)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TokenizedDataset, batch_size: int, pad_id: int, device: torch.device) -> float:
    """Mean loss per label token over the whole ``dataset`` (eval mode: no dropout, no gradient)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))], pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        total += summed_loss(model, batch).item()
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(tokens, 1)


def build_optimizer(params: list[nn.Parameter], cfg: dict[str, Any], device: torch.device) -> torch.optim.AdamW:
    """AdamW from the ``optimizer`` section; the fused kernel by default on CPU and CUDA.

    ``optimizer.fused``: null (default) picks fused where torch has it for the device (CPU,
    CUDA); false leaves the choice to torch (for-each on CUDA, the for-loop on CPU, where
    bench/optimizer.py measured for-each slower than it); true forces fused.
    """
    fused = cfg.get("fused")
    if fused is None:
        fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(
        params,
        lr=float(cfg.get("lr", 2e-5)),
        betas=tuple(cfg.get("betas", (0.9, 0.999))),
        weight_decay=float(cfg.get("weight_decay", 0.0)),
        fused=bool(fused),
    )


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder block in place (parameter names unchanged)."""
    for layer in model.layers:
        layer.compile()
