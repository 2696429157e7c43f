"""Mixture-of-experts rules shared by the MoE families: experts one tensor each, or stacked.

transformers 5 holds experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows
then up rows per expert; ``mlp.experts.down_proj`` [E, H, I]) and by default saves them one
tensor per expert under the family's historical names. Both layouts map to the same
canonical tensors (``layers.{i}.mlp.experts.{e}.w1/w3/w2.weight``, router
``layers.{i}.mlp.router.weight``); ``ModelConfig.experts_layout`` says which one a
checkpoint uses, from its tensor names (:func:`experts_layout_of`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.spec import Rule
from ckptkit.tensors.transforms import STACKED, STACKED_PAIRS

EXPERTS_LAYOUTS = ("per-expert", "stacked")
_STACKED_NAME = re.compile(r".*\.experts\.(gate_up_proj|down_proj)")
_PER_EXPERT_NAME = re.compile(r".*\.experts\.\d+\..*")


def expert_rules(
    cfg: ModelConfig, layer: int, per_expert_prefix: str, names: tuple[str, str, str], router: str, stacked_prefix: str
) -> tuple[Rule, ...]:
    """The rules of layer ``layer``'s experts and router in ``cfg.experts_layout``.

    ``names``: the per-expert native names of gate, up and down (``gate_proj``... or ``w1``,
    ``w3``, ``w2``) under ``per_expert_prefix`` + ``experts.E.``.
    """
    c = f"layers.{layer}.mlp."
    rules = [Rule(router, (c + "router.weight",))]
    if cfg.experts_layout == "stacked":
        gate_up = tuple(f"{c}experts.{e}.{w}.weight" for e in range(cfg.num_experts) for w in ("w1", "w3"))
        down = tuple(f"{c}experts.{e}.w2.weight" for e in range(cfg.num_experts))
        rules += [
            Rule(stacked_prefix + "experts.gate_up_proj", gate_up, STACKED_PAIRS),
            Rule(stacked_prefix + "experts.down_proj", down, STACKED),
        ]
        return tuple(rules)
    if cfg.experts_layout != "per-expert":
        raise CkptkitError(f"experts layout {cfg.experts_layout!r}: expected one of {', '.join(EXPERTS_LAYOUTS)}")
    for e in range(cfg.num_experts):
        for native, canon in zip(names, ("w1", "w3", "w2"), strict=True):
            rules.append(Rule(f"{per_expert_prefix}experts.{e}.{native}.weight", (f"{c}experts.{e}.{canon}.weight",)))
    return tuple(rules)


def experts_layout_of(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """``cfg`` with the experts layout its tensor names show (unchanged when they show none,
    as with canonical names); both at once is an error."""
    if not cfg.num_experts:
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
        return dataclasses.replace(cfg, experts_layout="stacked" if stacked else "per-expert")
    return cfg
