"""Mixture-of-experts rules shared by the MoE families: experts one tensor each, or stacked.

transformers 5 holds experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows
then up rows per expert; ``mlp.experts.down_proj`` [E, H, I]) and by default saves them one
tensor per expert under the family's historical names. Both layouts map to the same
canonical tensors (``layers.{i}.mlp.experts.{e}.w1/w3/w2.weight``, router
``layers.{i}.mlp.router.weight``); :attr:`MoEFields.experts_layout` says which one a
checkpoint uses, from its tensor names (:func:`experts_layout_of`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ckptkit.errors import CkptkitError
from ckptkit.models.config import FamilyFields, ModelConfig
from ckptkit.models.spec import Rule
from ckptkit.tensors.transforms import STACKED, STACKED_PAIRS

EXPERTS_LAYOUTS = ("per-expert", "stacked")
_STACKED_NAME = re.compile(r".*\.experts\.(gate_up_proj|down_proj)")
_PER_EXPERT_NAME = re.compile(r".*\.experts\.\d+\..*")


@dataclass
class MoEFields(FamilyFields):
    """Mixture of experts (0 experts: dense); the layers in ``dense_layers`` keep a dense MLP.

    Attributes:
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        experts_layout: how experts lie on disk: one tensor per expert (``per-expert``) or
            stacked 3-D (``stacked``).
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    dense_layers: list[int] | None = None
    experts_layout: str = "per-expert"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in (self.dense_layers or [])


def experts(cfg: ModelConfig) -> MoEFields | None:
    """The experts of ``cfg``; None for a dense model."""
    moe = cfg.feature(MoEFields)
    return moe if moe is not None and moe.num_experts else None


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` of ``cfg`` has experts rather than a dense MLP."""
    moe = experts(cfg)
    return moe is not None and moe.is_moe_layer(layer)


def expert_size(cfg: ModelConfig) -> int:
    """The hidden size of one expert's MLP."""
    return cfg.fields(MoEFields).moe_intermediate_size or cfg.intermediate_size


def expert_rules(
    cfg: ModelConfig, layer: int, per_expert_prefix: str, names: tuple[str, str, str], router: str, stacked_prefix: str
) -> tuple[Rule, ...]:
    """The rules of layer ``layer``'s experts and router in the config's ``experts_layout``.

    ``names``: the per-expert native names of gate, up and down (``gate_proj``... or ``w1``,
    ``w3``, ``w2``) under ``per_expert_prefix`` + ``experts.E.``.
    """
    c = f"layers.{layer}.mlp."
    moe = cfg.fields(MoEFields)
    rules = [Rule(router, (c + "router.weight",))]
    if moe.experts_layout == "stacked":
        gate_up = tuple(f"{c}experts.{e}.{w}.weight" for e in range(moe.num_experts) for w in ("w1", "w3"))
        down = tuple(f"{c}experts.{e}.w2.weight" for e in range(moe.num_experts))
        rules += [
            Rule(stacked_prefix + "experts.gate_up_proj", gate_up, STACKED_PAIRS),
            Rule(stacked_prefix + "experts.down_proj", down, STACKED),
        ]
        return tuple(rules)
    if moe.experts_layout != "per-expert":
        raise CkptkitError(f"experts layout {moe.experts_layout!r}: expected one of {', '.join(EXPERTS_LAYOUTS)}")
    for e in range(moe.num_experts):
        for native, canon in zip(names, ("w1", "w3", "w2"), strict=True):
            rules.append(Rule(f"{per_expert_prefix}experts.{e}.{native}.weight", (f"{c}experts.{e}.{canon}.weight",)))
    return tuple(rules)


def experts_layout_of(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """``cfg`` with the experts layout its tensor names show (unchanged when they show none,
    as with canonical names); both at once is an error."""
    if experts(cfg) is None:
        return cfg
    stacked = per_expert = False
    for name in names:
        if _STACKED_NAME.fullmatch(name):
            stacked = True
        elif name.startswith("model.") and _PER_EXPERT_NAME.fullmatch(name):
            per_expert = True
    if stacked and per_expert:
        raise CkptkitError("experts are stored both stacked and one tensor per expert; expected one layout")
    if stacked or per_expert:
        return cfg.replace_fields(experts_layout="stacked" if stacked else "per-expert")
    return cfg
