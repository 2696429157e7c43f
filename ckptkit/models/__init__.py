"""Model families: registry, detection, and canonical <-> HF key names."""

from __future__ import annotations

from typing import Any

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.models import gemma, gemma2, gemma3, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3
from ckptkit.models.config import ModelConfig, canonical_shapes
from ckptkit.models.family import Family, MetaSource
from ckptkit.models.moe import EXPERTS_LAYOUTS

FAMILY_MODULES = (llama, mistral, qwen2, gemma, phi3, qwen3, mixtral, gemma2, gemma3, olmo2)
META_DETECTION = (mixtral, mistral, llama)
REGISTRY: dict[str, Family] = {f.name: f for mod in FAMILY_MODULES for f in mod.FAMILIES}
MODEL_TYPES = tuple(REGISTRY)

__all__ = [
    "EXPERTS_LAYOUTS",
    "MODEL_TYPES",
    "REGISTRY",
    "Family",
    "MetaSource",
    "ModelConfig",
    "canonical_shapes",
    "get_family",
    "detect_from_hf",
    "detect_from_meta",
    "hf_key",
    "canonical_key",
]


def get_family(model_type: str) -> Family:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnknownModel(f"unknown model type {model_type!r}; supported: {', '.join(MODEL_TYPES)}") from None


def detect_from_hf(cfg: dict[str, Any], where: str) -> Family:
    """The family of an HF ``config.json``; an error that asks for --model-type when unsure.

    A family module's own ``detect_hf`` (Llama's tells its versions apart) goes first;
    otherwise ``model_type`` names the family.
    """
    for module in FAMILY_MODULES:
        detect = getattr(module, "detect_hf", None)
        name = detect(cfg, where) if detect else None
        if name:
            return REGISTRY[name]
    hf_type = cfg.get("model_type")
    for family in REGISTRY.values():
        if hf_type in family.hf_model_types:
            return family
    raise UnknownModel(
        f"{where}: unsupported model_type {hf_type!r}; supported: {', '.join(MODEL_TYPES)} "
        "(pass --model-type to force one)"
    )


def detect_from_meta(src: MetaSource, where: str) -> Family:
    """The family of a Meta-style checkpoint; an error that asks for --model-type when unsure.

    Each family module with a ``detect_meta`` is asked in :data:`META_DETECTION` order
    (specific families first, Llama, the catch-all, last).
    """
    for module in META_DETECTION:
        name = module.detect_meta(src, where)
        if name:
            return REGISTRY[name]
    raise CkptkitError(f"{where}: no model family recognises this params.json; pass --model-type")


def _one_to_one(model_type: str) -> dict[str, str]:
    cfg = ModelConfig(model_type, 2, 2, 1, 1, 1, 2, 2, attention_bias=True)
    rules = get_family(model_type).hf_layout(cfg).expand(1)
    return {r.native: r.canonical[0] for r in rules if len(r.canonical) == 1}


def hf_key(model_type: str, canonical: str) -> str:
    """The HF name of a canonical tensor (``layers.0.attn.q_proj.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``), for 1:1-mapped tensors."""
    layer, generic = _generic(canonical)
    for native, canon in _one_to_one(model_type).items():
        if canon == generic:
            return native.replace("layers.0.", f"layers.{layer}.") if layer is not None else native
    if canonical == "output.weight":
        return "lm_head.weight"
    raise CkptkitError(f"{model_type}: no one-to-one HF name for canonical tensor {canonical!r}")


def canonical_key(model_type: str, hf: str) -> str:
    """Inverse of :func:`hf_key`."""
    layer, generic = _generic(hf)
    for native, canon in _one_to_one(model_type).items():
        if native == generic:
            return canon.replace("layers.0.", f"layers.{layer}.") if layer is not None else canon
    if hf == "lm_head.weight":
        return "output.weight"
    raise CkptkitError(f"{model_type}: no one-to-one canonical name for HF tensor {hf!r}")


def _generic(name: str) -> tuple[int | None, str]:
    """Split ``...layers.12.x`` into (12, ``...layers.0.x``)."""
    import re

    m = re.search(r"layers\.(\d+)\.", name)
    if not m:
        return None, name
    return int(m.group(1)), name[: m.start()] + "layers.0." + name[m.end() :]
