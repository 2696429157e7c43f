"""The family registry: every model type ckptkit knows, by name, and how a checkpoint's
config tells which one it is.

A family module registers its families when imported (``register(MyFamily())``);
:mod:`ckptkit.models` imports the built-in ones. The CLI's ``--model-type`` choices,
detection, the support matrix and GGUF's architecture lookup all ask this registry, so a
new family needs no edit anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.models.family import Family, MetaSource
from ckptkit.models.fields import set_family_checks

HFDetector = Callable[[dict[str, Any], str], str | None]
MetaDetector = Callable[[MetaSource, str], str | None]

REGISTRY: dict[str, Family] = {}
_HF_DETECTORS: list[HFDetector] = []
_META_DETECTORS: list[MetaDetector] = []


def register(*families: Family, detect_hf: HFDetector | None = None, detect_meta: MetaDetector | None = None) -> None:
    """Add ``families`` under their names (a name already taken is an error).

    ``detect_hf(config_json, where)``: the name of the family an HF config.json describes when
    its ``model_type`` alone cannot tell (Llama's versions), None when not one of these.
    ``detect_meta(source, where)``: the same for Meta's params.json; the detectors registered
    last are asked first (a family registered after the one it refines, Mixtral after
    Mistral after Llama, is the more specific).
    """
    for family in families:
        if family.name in REGISTRY:
            raise ValueError(f"model type {family.name!r} is already registered")
    for family in families:
        REGISTRY[family.name] = family
    _checks_changed()
    if detect_hf is not None:
        _HF_DETECTORS.append(detect_hf)
    if detect_meta is not None:
        _META_DETECTORS.insert(0, detect_meta)


def unregister(*names: str, detect_hf: HFDetector | None = None, detect_meta: MetaDetector | None = None) -> None:
    """Remove the families registered as ``names`` and their detectors (tests that register their own)."""
    for name in names:
        del REGISTRY[name]
    _checks_changed()
    if detect_hf is not None:
        _HF_DETECTORS.remove(detect_hf)
    if detect_meta is not None:
        _META_DETECTORS.remove(detect_meta)


def _checks_changed() -> None:
    checks: dict[str, Any] = {}
    for family in REGISTRY.values():
        checks |= {k: c for k, c in family.fields.all_checks().items() if k not in checks}
    set_family_checks(checks)


def model_types() -> list[str]:
    """The registered model types, in registration order."""
    return list(REGISTRY)


def get_family(model_type: str) -> Family:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnknownModel(f"unknown model type {model_type!r}; supported: {', '.join(REGISTRY)}") from None


def detect_from_hf(cfg: dict[str, Any], where: str) -> Family:
    """The family of an HF ``config.json``; an error that asks for --model-type when unsure.

    A registered ``detect_hf`` (Llama's tells its versions apart) goes first; otherwise
    ``model_type`` names the family.
    """
    for detect in _HF_DETECTORS:
        name = detect(cfg, where)
        if name:
            return REGISTRY[name]
    hf_type = cfg.get("model_type")
    for family in REGISTRY.values():
        if hf_type in family.hf_model_types:
            return family
    raise UnknownModel(
        f"{where}: unsupported model_type {hf_type!r}; supported: {', '.join(REGISTRY)} "
        "(pass --model-type to force one)"
    )


def detect_from_meta(src: MetaSource, where: str) -> Family:
    """The family of a Meta-style checkpoint; an error that asks for --model-type when unsure.

    The registered ``detect_meta`` functions are asked, the last registered first (specific
    families first, Llama, the catch-all, last).
    """
    for detect in _META_DETECTORS:
        name = detect(src, where)
        if name:
            return REGISTRY[name]
    raise CkptkitError(f"{where}: no model family recognises this params.json; pass --model-type")
