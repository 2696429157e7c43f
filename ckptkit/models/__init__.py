"""Model families: registry, detection, and canonical <-> HF key names."""

from __future__ import annotations

from ckptkit.errors import CkptkitError
from ckptkit.models.config import FamilyFields, ModelConfig
from ckptkit.models.family import Family, MetaSource
from ckptkit.models.moe import EXPERTS_LAYOUTS
from ckptkit.models.registry import (
    REGISTRY,
    detect_from_hf,
    detect_from_meta,
    get_family,
    model_types,
    register,
    unregister,
)
from ckptkit.models.shapes import canonical_shapes

# The built-in families, each registered as its module is imported, in this order.
# isort: off
from ckptkit.models import llama, mistral, qwen2, gemma, phi3, qwen3, mixtral, gemma2, gemma3, olmo2  # noqa: F401
from ckptkit.models import deepseek_v3, gpt_oss, glm4_moe, llama4  # noqa: F401
from ckptkit.models import qwen3_next, qwen3_5, gemma4  # noqa: F401
# isort: on

__all__ = [
    "EXPERTS_LAYOUTS",
    "REGISTRY",
    "Family",
    "FamilyFields",
    "MetaSource",
    "ModelConfig",
    "canonical_shapes",
    "get_family",
    "detect_from_hf",
    "detect_from_meta",
    "hf_key",
    "canonical_key",
    "model_types",
    "register",
    "unregister",
]


def _one_to_one(model_type: str) -> dict[str, str]:
    """HF name -> canonical name of every 1:1-mapped tensor, layer indices as ``layers.0.``."""
    family = get_family(model_type)
    out: dict[str, str] = {}
    for cfg in family.sample_configs():
        for r in family.hf_layout(cfg).expand(cfg.num_layers):
            if len(r.canonical) == 1:
                out.setdefault(_generic(r.native)[1], _generic(r.canonical[0])[1])
    return out


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
