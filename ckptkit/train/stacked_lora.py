"""LoRA on stacked expert tensors (gpt-oss's and Llama 4's ``gate_up_proj``/``down_proj``) as PEFT
adapts them through ``target_parameters`` (its ``ParamWrapper``).

A stacked parameter [E, rows, cols] gets one ``lora_a`` [E * r, in] and one ``lora_b``
[out, r * E]: expert e's A is rows ``e*r`` to ``e*r + r`` of ``lora_a``, its B the columns
``j*E + e`` of ``lora_b``. Where the experts module says its tensors are ``x @ W`` (gpt-oss,
``is_transposed`` in transformers) ``in``/``out`` are ``rows``/``cols`` and expert e's delta is
``scaling * (B_e A_e)^T``; elsewhere (Llama 4) they are ``cols``/``rows`` and the delta is
``scaling * B_e A_e``. No dropout (it cannot be factored out of a weight delta), no DoRA.
The adapter is a child module ``<parameter>_lora`` of the experts module, so its state-dict
keys end in ``.lora_a``/``.lora_b`` like every other adapter's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ckptkit.errors import CkptkitError

STACKED = ("gate_up_proj", "down_proj")
"""The stacked expert parameters LoRA adapts, in the experts module's order."""
SUFFIX = "_lora"


class StackedLoRA(nn.Module):
    """The low-rank update of one stacked expert parameter [E, rows, cols] (frozen, not held here)."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        rank: int,
        alpha: float,
        transposed: bool,
        use_rslora: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rank <= 0:
            raise CkptkitError(f"LoRA rank must be positive, got {rank}")
        self.experts, rows, cols = shape
        self.transposed = transposed  # x @ W per expert: in = rows, out = cols
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        self.merged = False
        self.reset_lora(torch.device(device or "cpu"), dtype)

    def reset_lora(self, device: torch.device, dtype: torch.dtype) -> None:
        """PEFT's init of the stacked pair: A kaiming-uniform (as an ``nn.Linear`` weight), B zeros."""
        n = self.rank * self.experts
        self.lora_a = nn.Parameter(torch.empty(n, self.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, n, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    use_dora = False

    def adapted(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight + delta`` as PEFT's forward folds it (one ``baddbmm`` in the weight's dtype)."""
        if self.merged:
            return weight
        lhs, rhs = factors(self.lora_a, self.lora_b, self.experts, self.transposed)
        return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=self.scaling)

    def delta(self) -> torch.Tensor:
        """PEFT's delta weight [E, rows, cols], in the adapter's dtype."""
        return delta(self.lora_a, self.lora_b, self.scaling, self.experts, self.transposed)

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight + delta``, the delta rounded to the weight's dtype first, as PEFT's merge adds it."""
        return weight + self.delta().to(weight.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.experts}, in={self.in_features}, out={self.out_features}, rank={self.rank}"


def factors(a: torch.Tensor, b: torch.Tensor, experts: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lhs, rhs)``, each [E, ., .], with ``delta = scaling * lhs @ rhs`` shaped as the stacked
    parameter, from PEFT's ``a`` [E * r, in] and ``b`` [out, r * E]."""
    a3 = a.reshape(experts, -1, a.shape[-1])  # (E, r, in)
    b3 = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # (E, out, r)
    return (a3.transpose(-2, -1), b3.transpose(-2, -1)) if transposed else (b3, a3)


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float, experts: int, transposed: bool) -> torch.Tensor:
    """``scaling * lhs @ rhs`` (:func:`factors`) [E, rows, cols], in the pair's dtype."""
    lhs, rhs = factors(a, b, experts, transposed)
    return (lhs @ rhs) * scaling


def weight(experts: nn.Module, name: str) -> torch.Tensor:
    """The experts module's stacked parameter ``name`` with its adapter (if any) applied."""
    w: torch.Tensor = getattr(experts, name)
    lora = getattr(experts, name + SUFFIX, None)
    return w if lora is None else lora.adapted(w)


def stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> experts module holding stacked ``gate_up_proj``/``down_proj`` parameters."""
    return {
        name: m
        for name, m in model.named_modules()
        if all(isinstance(getattr(m, p, None), nn.Parameter) and getattr(m, p).ndim == 3 for p in STACKED)
    }


def add_stacked_lora(
    model: nn.Module, ranks: dict[str, int], alpha: float, use_rslora: bool = False, dtype: torch.dtype | None = None
) -> None:
    """Adapt exactly the named stacked parameters (``layers.N.mlp.experts.gate_up_proj`` -> rank)."""
    for name, rank in ranks.items():
        owner, _, leaf = name.rpartition(".")
        experts = stacked_experts(model).get(owner)
        if experts is None or leaf not in STACKED:
            raise CkptkitError(f"model has no stacked expert tensor {name!r} to put a LoRA adapter on")
        w: torch.Tensor = getattr(experts, leaf)
        w.requires_grad_(False)
        if dtype is None:
            dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        transposed = getattr(experts, "transposed", True)
        device = torch.device("cpu") if w.is_meta else w.device
        lora = StackedLoRA(tuple(w.shape), rank, alpha, transposed, use_rslora, dtype, device)  # type: ignore[arg-type]
        experts.add_module(leaf + SUFFIX, lora)


def stacked_modules(model: nn.Module) -> dict[str, StackedLoRA]:
    """Canonical stacked parameter (``layers.N.mlp.experts.gate_up_proj``) -> its adapter."""
    return {name.removesuffix(SUFFIX): m for name, m in model.named_modules() if isinstance(m, StackedLoRA)}


def stacked_names(model: nn.Module) -> list[str]:
    """Every stacked expert parameter of the model LoRA's ``experts`` target adapts."""
    return [f"{owner}.{p}" for owner in stacked_experts(model) for p in STACKED]


@torch.no_grad()
def merge_stacked(model: nn.Module, merge: bool = True) -> None:
    """Fold (``merge``) or take out again each stacked adapter's delta in its parameter."""
    for name, lora in stacked_modules(model).items():
        if lora.merged == merge:
            continue
        w: torch.Tensor = model.get_parameter(name)
        w.copy_(lora.merged_weight(w) if merge else w - lora.delta().to(w.dtype))
        lora.merged = merge


def merged_stacked(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical stacked parameter -> its merged value, for the unmerged adapters (model unchanged)."""
    return {
        name: lora.merged_weight(model.get_parameter(name).detach()).detach()
        for name, lora in stacked_modules(model).items()
        if not lora.merged
    }
