"""Which modules LoRA can adapt, checked against the model before any weight is read.

Where a family fuses projections into one HF module (Phi-3's ``qkv_proj``, ``gate_up_proj``),
PEFT adapts the fused module whole: one A, and a B whose rows stack the parts. ckptkit's
separate q/k/v (w1/w3) adapters then share one ``lora_a`` and their ``lora_b`` are that B's
row blocks; targeting only some parts is refused.
"""

from __future__ import annotations

import re

from torch import nn

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig, get_family
from ckptkit.models.gemma4 import Gemma4Fields
from ckptkit.models.gpt_oss import GptOssFields
from ckptkit.models.hybrid import HybridFields
from ckptkit.models.moe import experts
from ckptkit.train.lora import EXPERTS, TARGETS, LoRALinear, lora_modules, model_config, resolve_targets


def fused_modules(model_type: str) -> dict[str, tuple[str, ...]]:
    """HF module -> the canonical modules it stacks on dim 0, for layer 0 (``{i}`` unset)."""
    from ckptkit.tensors.transforms import FUSED

    family = get_family(model_type)
    cfg = ModelConfig(model_type, 2, 2, 1, 1, 1, 2, 2, attention_bias=True, extra=family.fields())
    rules = family.hf_layout(cfg).expand(1)
    return {
        r.native.removesuffix(".weight"): tuple(c.removesuffix(".weight") for c in r.canonical)
        for r in rules
        if r.kind is FUSED
    }


def fused_part(model_type: str, canonical_module: str) -> tuple[str, int, int] | None:
    """(HF fused module, index of the part, number of parts) for a canonical module that is a part."""
    match = re.match(r"layers\.(\d+)\.", canonical_module)
    if match is None:
        return None
    generic = "layers.0." + canonical_module[match.end() :]
    for fused, members in fused_modules(model_type).items():
        if generic in members:
            return fused.replace("layers.0.", match.group(0), 1), members.index(generic), len(members)
    return None


def check_targets(targets: list[str], cfg: ModelConfig, dropout: float = 0.0) -> None:
    """``lora.targets`` checked against the model before any weight is read: tied output,
    fused modules (targeted whole or not at all, as PEFT adapts them), experts and router
    (a model with experts; no dropout, which PEFT's adapters of stacked tensors lack)."""
    leaves = resolve_targets(targets)
    short = {leaf: name for name, leaf in TARGETS.items()}
    moe = sorted(leaves & {EXPERTS, "router"})
    has_experts = experts(cfg)
    if cfg.feature(GptOssFields) is not None and leaves & {"w1", "w2", "w3"}:
        names = " ".join(short.get(leaf, leaf) for leaf in sorted(leaves & {"w1", "w2", "w3"}))
        raise CkptkitError(
            f"lora.targets: {names} adapt dense MLPs and every {cfg.model_type} layer has stacked experts "
            "instead: use experts (and router)"
        )
    if cfg.feature(GptOssFields) is not None:  # router and stacked experts: bare parameters, as PEFT adapts them
        if moe and dropout:
            raise CkptkitError(
                f"lora.dropout: PEFT adapts {cfg.model_type}'s {' and '.join(moe)} as parameters, without dropout; "
                f"set lora.dropout to 0 or remove {' and '.join(moe)} from lora.targets"
            )
        moe = []
    gemma4 = cfg.feature(Gemma4Fields)
    if gemma4 is not None and gemma4.enable_moe_block and moe:
        raise CkptkitError(
            f"lora.targets: {' '.join(moe)}: LoRA on {cfg.model_type}'s stacked experts and router is not "
            "supported yet; adapt attention and the dense MLP beside them (q k v o gate up down)"
        )
    if moe and has_experts is None:
        raise CkptkitError(
            f"lora.targets: {cfg.model_type} has no experts; remove {' and '.join(moe)} from lora.targets"
        )
    dense_mlp = sorted(leaves & {"w1", "w2", "w3"})
    hybrid = cfg.feature(HybridFields)
    shared = hybrid is not None and hybrid.shared_expert_intermediate_size > 0  # gate/up/down adapt the shared expert
    if dense_mlp and has_experts is not None and not has_experts.dense_layers and not shared:
        names = " ".join(short.get(leaf, leaf) for leaf in dense_mlp)
        raise CkptkitError(
            f"lora.targets: {names} adapt dense MLPs and every {cfg.model_type} layer has experts instead: "
            "use experts (and router)"
        )
    if moe and dropout:
        raise CkptkitError(
            f"lora.dropout: PEFT adapts {' and '.join(moe)} as stacked tensors, without dropout; "
            f"set lora.dropout to 0 or remove {' and '.join(moe)} from lora.targets"
        )
    if "output" in leaves and cfg.tie_word_embeddings:
        raise CkptkitError(
            f"lora.targets: {cfg.model_type} ties the output projection to the embeddings, so it has no weight "
            "of its own to adapt; remove output from lora.targets"
        )
    for fused, members in fused_modules(cfg.model_type).items():
        wanted = {m.rsplit(".", 1)[-1] for m in members}
        chosen = leaves & wanted
        if chosen and chosen != wanted:
            names = " ".join(short.get(m.rsplit(".", 1)[-1], m) for m in members)
            raise CkptkitError(
                f"lora.targets: {cfg.model_type} stores {names} as one module ({fused.rsplit('.', 1)[-1]}) and PEFT "
                f"adapts it whole: list all of {names} or none of them"
            )


EXPERT_MODULE = re.compile(r"(layers\.\d+\.mlp\.experts\.\d+)\.(w1|w3|w2)")


def share_fused_lora(model: nn.Module) -> None:
    """Give the adapted parts of each fused module one shared ``lora_a`` (PEFT's single A);
    an expert's gate and up are such parts (of transformers' stacked ``gate_up_proj``)."""
    groups: dict[str, list[LoRALinear]] = {}
    for name, m in lora_modules(model).items():
        expert = EXPERT_MODULE.fullmatch(name)
        if expert is not None and expert.group(2) != "w2":
            groups.setdefault(expert.group(1) + ".gate_up", []).append(m)
            continue
        where = fused_part(model_config(model).model_type, name)
        if where is not None:
            groups.setdefault(where[0], []).append(m)
    for fused, members in groups.items():
        if len({(m.rank, m.in_features) for m in members}) != 1:
            raise CkptkitError(f"the parts of fused {fused} need one LoRA rank")
        for m in members[1:]:
            m.lora_a = members[0].lora_a


def fused_parts(model_type: str, hf_module: str) -> tuple[str, ...] | None:
    """The canonical modules an HF fused module stacks, or None when it is not fused."""
    match = re.search(r"layers\.(\d+)\.", hf_module)
    if match is None:
        return None
    generic = hf_module[: match.start()] + "layers.0." + hf_module[match.end() :]
    members = fused_modules(model_type).get(generic)
    return None if members is None else tuple(m.replace("layers.0.", match.group(0), 1) for m in members)
