"""The HF module names PEFT adapters use for ckptkit's canonical modules, and back: the
family's one-to-one names (:func:`ckptkit.models.hf_key`), those of the checkpoint's own
config first (a multimodal release's text model lies under ``language_model.``), fused
modules by :mod:`ckptkit.train.lora_targets`."""

from __future__ import annotations

from collections.abc import Mapping

from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig, canonical_key, get_family, hf_key
from ckptkit.train.lora_targets import fused_part


def module_names(cfg: ModelConfig) -> dict[str, str]:
    """Canonical module -> HF module of each 1:1-mapped weight of ``cfg``'s own HF layout (a
    multimodal release's names: ``language_model.model.layers...``)."""
    names: dict[str, str] = {}
    for r in get_family(cfg.model_type).hf_layout(cfg).expand(cfg.num_layers):
        if len(r.canonical) == 1 and r.canonical[0].endswith(".weight") and r.native.endswith(".weight"):
            # the first rule of a weight names its module (a tied model's lm_head is a second one)
            names.setdefault(r.canonical[0].removesuffix(".weight"), r.native.removesuffix(".weight"))
    return names


def hf_module(model_type: str, canonical_module: str, names: Mapping[str, str] | None = None) -> str:
    """The HF module of a canonical one, from ``names`` (:func:`module_names`) where given."""
    fused = fused_part(model_type, canonical_module)
    if fused is not None:
        return fused[0]
    if names is not None and canonical_module in names:
        return names[canonical_module]
    try:
        name = hf_key(model_type, f"{canonical_module}.weight")
    except (CkptkitError, KeyError, ValueError) as exc:
        raise CkptkitError(
            f"LoRA on {canonical_module} cannot be written in PEFT format for {model_type} "
            f"(no 1:1 Hugging Face module, e.g. Phi-3's fused qkv_proj/gate_up_proj): {exc}"
        ) from None
    return name.removesuffix(".weight")


class NotInBase(CkptkitError):
    """An adapter names a module that the base model's type does not have."""


def canonical_module(model_type: str, hf_module: str, names: Mapping[str, str] | None = None) -> str:
    """The canonical module of an HF one, from ``names`` (HF -> canonical) where given."""
    if names is not None and hf_module in names:
        return names[hf_module]
    try:
        if hf_module.rsplit(".", 1)[-1] in ("qkv_proj", "gate_up_proj"):  # fused where model_type is not
            raise KeyError(hf_module)
        name = canonical_key(model_type, f"{hf_module}.weight")
    except (CkptkitError, KeyError, ValueError):
        raise NotInBase(f"the adapter targets {hf_module}, which a {model_type} model does not have") from None
    return name.removesuffix(".weight")
