"""LoRA for the native model: low-rank adapters on chosen projections, exact merge/unmerge.

A :class:`LoRALinear` *is* an ``nn.Linear`` (same ``weight``/``bias`` names, so the
base state dict keeps its canonical keys) with two extra parameters, ``lora_a``
(r, in) and ``lora_b`` (out, r), initialised as PEFT does (A kaiming-uniform, B zeros)
and applied as ``W x + (alpha / r) * B A dropout(x)``. With ``use_dora`` (DoRA, as PEFT
defines it) a third, ``lora_magnitude`` (out,), rescales each output row: the weight is
``m * (W + s B A) / ||W + s B A||`` row-wise, the norm detached from the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig
from ckptkit.train.stacked_lora import add_stacked_lora, merge_stacked, merged_stacked, stacked_names

# Short target names -> canonical module leaf names (ckptkit.models.config docstring).
# gate/up/down are the dense MLPs' projections; ``experts`` every expert's three (a
# mixture-of-experts layer's ``mlp.experts.E.w1/w3/w2``), ``router`` the experts' router;
# q_a/q_b/kv_a/kv_b the projections of latent attention; in_proj_*/out_proj those of linear attention.
TARGETS: dict[str, str] = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "output_proj",
    "gate": "w1",
    "up": "w3",
    "down": "w2",
    "output": "output",
    "experts": "experts",
    "router": "router",
    "q_a": "q_a_proj",  # latent attention (DeepSeek V3): the queries' low-rank pair
    "q_b": "q_b_proj",
    "kv_a": "kv_a_proj",  # and the keys' and values' latent (HF kv_a_proj_with_mqa)
    "kv_b": "kv_b_proj",
    # Gated DeltaNet (Qwen3-Next: in_proj_qkvz, in_proj_ba; Qwen3.5: in_proj_qkv/z/b/a), its out_proj
    "in_proj_qkvz": "in_proj_qkvz",
    "in_proj_ba": "in_proj_ba",
    "in_proj_qkv": "in_proj_qkv",
    "in_proj_z": "in_proj_z",
    "in_proj_b": "in_proj_b",
    "in_proj_a": "in_proj_a",
    "out_proj": "out_proj",
}
EXPERTS = "experts"
ADAPTER_SUFFIXES = (".lora_a", ".lora_b", ".lora_magnitude")
"""State-dict key endings of the adapter tensors (the magnitude only with DoRA)."""


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update; base weight and bias are frozen.

    ``scaling`` is ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``); ``use_dora``
    adds the magnitude vector (row norms of the base weight at init, in the adapter dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        bias: bool = False,
        use_rslora: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        lora_dtype: torch.dtype | None = None,
        use_dora: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if rank <= 0:
            raise CkptkitError(f"LoRA rank must be positive, got {rank}")
        self.rank, self.alpha, self.use_rslora, self.use_dora = rank, alpha, use_rslora, use_dora
        self.merged_norm: torch.Tensor | None = None  # DoRA: the row norms the merge divided by
        self.scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        self.merged = False
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.reset_lora(self.weight.device, lora_dtype or self.weight.dtype)

    def reset_lora(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fresh adapter tensors with PEFT's default init: A kaiming-uniform, B zeros; DoRA's
        magnitude the base weight's row norms (on the meta device while the weight is there)."""
        self.lora_a = nn.Parameter(torch.empty(self.rank, self.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, self.rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        if self.use_dora:
            w = self.weight.detach()
            self.lora_magnitude = nn.Parameter(dora_magnitude(w if w.is_meta else w.to(device), dtype))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        lora_dtype: torch.dtype | None = None,
        use_dora: bool = False,
    ) -> LoRALinear:
        """Wrap an existing linear, sharing its weight and bias tensors.

        Adapters of half-precision bases are float32 by default (PEFT's ``autocast_adapter_dtype``).
        """
        w = linear.weight
        if lora_dtype is None:
            lora_dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        lora = cls(
            linear.in_features,
            linear.out_features,
            rank,
            alpha,
            dropout,
            linear.bias is not None,
            use_rslora,
            device="meta",
            use_dora=use_dora,
        )
        lora.weight = nn.Parameter(w.data, requires_grad=False)
        if linear.bias is not None:
            lora.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        lora.reset_lora(w.device, lora_dtype)
        for name, buffer in linear.named_buffers(recurse=False):  # a router's expert_bias
            lora.register_buffer(name, buffer)
        return lora

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in float32."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        if self.merged:
            return result
        if self.use_dora:
            return self._dora_forward(x, result)
        a = self.dropout(x).to(self.lora_a.dtype)
        update = F.linear(F.linear(a, self.lora_a), self.lora_b) * self.scaling
        return (result + update).to(result.dtype)  # summed in the wider dtype, like PEFT

    def _dora_forward(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """PEFT's DoRA forward: ``result + (s - 1) * (W x) + s * scaling * B A x`` with
        ``s = m / ||W + scaling * B A||`` per output row, in the adapter dtype."""
        x = x.to(self.lora_a.dtype)
        weight = self.weight.to(x.dtype)
        delta = (self.lora_b @ self.lora_a).detach()
        norm = torch.linalg.norm(weight + self.scaling * delta, dim=1).detach()
        scale = (self.lora_magnitude / norm).view(1, -1)
        if isinstance(self.dropout, nn.Identity) or not self.training:
            base = result if self.bias is None else result - self.bias
        else:
            x = self.dropout(x)
            base = F.linear(x, weight)
        lora = F.linear(F.linear(x, self.lora_a), self.lora_b)
        return (result + ((scale - 1) * base + scale * lora * self.scaling)).to(result.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into ``weight`` (computed in float32, rounded once)."""
        if not self.merged:
            magnitude = self.lora_magnitude if self.use_dora else None
            if magnitude is not None:
                self.merged_norm = dora_norm(self.weight, self.lora_a, self.lora_b, self.scaling)
            self.weight.copy_(merged_weight(self.weight, self.lora_a, self.lora_b, self.scaling, magnitude))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update again (exact up to float rounding of the weight dtype)."""
        if self.merged:
            if self.merged_norm is not None:  # PEFT's rule: W / (m / norm) - delta
                delta = (self.lora_b @ self.lora_a) * self.scaling
                factor = (self.lora_magnitude / self.merged_norm).view(-1, 1)
                self.weight.copy_((self.weight / factor - delta).to(self.weight.dtype))
                self.merged_norm = None
            else:
                self.weight.copy_((self.weight.float() - self.delta_weight()).to(self.weight.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        dora = ", dora=True" if self.use_dora else ""
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}{dora}, merged={self.merged}"


def resolve_targets(targets: Iterable[str]) -> set[str]:
    """Canonical leaf names for short names (``q``, ``gate``...) or canonical leaf names."""
    leaves = set()
    for t in targets:
        if t in TARGETS:
            leaves.add(TARGETS[t])
        elif t in TARGETS.values():
            leaves.add(t)
        else:
            raise CkptkitError(f"unknown LoRA target {t!r}; choose from {', '.join(TARGETS)}")
    return leaves


def targeted(name: str, leaves: set[str]) -> bool:
    """Whether module ``name`` is one of ``leaves`` (:func:`resolve_targets`): an expert's
    projection (``layers.N.mlp.experts.E.w1``) only with ``experts``, any other by its leaf."""
    parts = name.split(".")
    if len(parts) > 2 and parts[-3] == EXPERTS:
        return EXPERTS in leaves
    return parts[-1] in leaves


def apply_lora(
    model: nn.Module,
    targets: Iterable[str] = ("q", "v"),
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    layers: Iterable[int] | None = None,
    ranks: dict[str, int] | None = None,
    use_rslora: bool = False,
    lora_dtype: torch.dtype | None = None,
    use_dora: bool = False,
) -> nn.Module:
    """Replace the targeted linears with :class:`LoRALinear` in place and freeze everything else.

    ``targets``: short names (see :data:`TARGETS`) or canonical leaf names. ``layers``
    restricts to those layer indices. ``ranks`` overrides the rank per canonical module
    name (e.g. ``{"layers.0.attn.q_proj": 4}``; scaling stays ``alpha / rank``).
    """
    leaves = resolve_targets(targets)
    if "output" in leaves and getattr(model, "output", None) is None:
        raise CkptkitError("LoRA on the output projection is not supported for tied embeddings")
    keep = set(layers) if layers is not None else None
    names = []
    for name, module in model.named_modules():
        if not targeted(name, leaves) or not isinstance(module, nn.Linear):
            continue
        if keep is not None and name.startswith("layers.") and int(name.split(".")[1]) not in keep:
            continue
        names.append(name)
    stacked = [n for n in stacked_names(model) if EXPERTS in leaves and (keep is None or int(n.split(".")[1]) in keep)]
    if not names and not stacked:
        raise CkptkitError(f"no module matches LoRA targets {sorted(leaves)}")
    if stacked and (dropout or use_dora):
        raise CkptkitError("LoRA on stacked experts takes no dropout and no DoRA (PEFT has neither there)")
    add_lora(model, {n: (ranks or {}).get(n, rank) for n in names}, alpha, dropout, use_rslora, lora_dtype, use_dora)
    add_stacked_lora(model, {n: (ranks or {}).get(n, rank) for n in stacked}, alpha, use_rslora, lora_dtype)
    return model


def add_lora(
    model: nn.Module,
    ranks: dict[str, int],
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    lora_dtype: torch.dtype | None = None,
    use_dora: bool = False,
) -> nn.Module:
    """Wrap exactly the named linears (canonical module name -> rank); freeze all base parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, rank in ranks.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CkptkitError(f"model has no module {name!r} to put a LoRA adapter on") from None
        if isinstance(module, LoRALinear):
            raise CkptkitError(f"{name} already has a LoRA adapter")
        if not isinstance(module, nn.Linear):
            raise CkptkitError(f"{name} is not a linear layer; LoRA supports linear layers only")
        parent_name, _, leaf = name.rpartition(".")
        setattr(
            model.get_submodule(parent_name),
            leaf,
            LoRALinear.from_linear(module, rank, alpha, dropout, use_rslora, lora_dtype, use_dora),
        )
    return model


def model_config(model: nn.Module) -> ModelConfig:
    """The :class:`ModelConfig` a native model was built from."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise CkptkitError(f"{type(model).__name__} is not a ckptkit model (no ModelConfig)")
    return config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """A native model's decoder blocks."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CkptkitError(f"{type(model).__name__} is not a ckptkit model (no decoder layers)")
    return layers


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Canonical module name -> LoRA module."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (forward then skips the adapters)."""
    for m in lora_modules(model).values():
        m.merge()
    merge_stacked(model)


def unmerge_lora(model: nn.Module) -> None:
    """Undo :func:`merge_lora`."""
    for m in lora_modules(model).values():
        m.unmerge()
    merge_stacked(model, merge=False)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, ``<module>.lora_a`` / ``.lora_b`` (and DoRA's ``.lora_magnitude``)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith(ADAPTER_SUFFIXES)}


def base_state_dict(model: nn.Module, merged: bool = True) -> dict[str, torch.Tensor]:
    """Canonical state dict without adapter tensors; ``merged`` folds the adapters in.

    Weights stay in their own dtype; the merge is computed in float32 and rounded once.
    The model itself is left unchanged.
    """
    out = {k: v for k, v in model.state_dict().items() if not k.endswith(ADAPTER_SUFFIXES)}
    if merged:
        for name, m in lora_modules(model).items():
            if not m.merged:
                magnitude = m.lora_magnitude.detach() if m.use_dora else None
                out[f"{name}.weight"] = merged_weight(
                    m.weight.detach(), m.lora_a.detach(), m.lora_b.detach(), m.scaling, magnitude
                )
        out.update(merged_stacked(model))
    return out


def merged_weight(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W + scaling * B @ A`` computed in float32 and rounded once to ``W``'s dtype; with a
    DoRA ``magnitude``, PEFT's merge: ``(m / ||W + delta||)[:, None] * (W + delta)``, delta
    in the adapter dtype, the sum in the wider of the two, rounded once."""
    if magnitude is not None:
        factor = magnitude / dora_norm(weight, lora_a, lora_b, scaling)
        return (factor.view(-1, 1) * (weight + (lora_b @ lora_a) * scaling)).to(weight.dtype)
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def dora_norm(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """Row norms of ``W + scaling * B @ A`` (delta in the adapter dtype), as PEFT's merge takes them."""
    combined = weight + (lora_b @ lora_a) * scaling
    return torch.linalg.norm(combined, dim=1).to(combined.dtype)


def dora_magnitude(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DoRA's initial magnitude: the row norms of ``weight`` (B is zero), computed in the wider
    of the weight's and the adapter's dtype and stored in the adapter's."""
    wide = torch.promote_types(weight.dtype, dtype)
    return torch.linalg.norm(weight.to(wide), dim=1).to(dtype)
