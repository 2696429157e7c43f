"""NVIDIA modelopt FP8 releases (``quant_method: "modelopt"``, ``quant_algo: "FP8"``):
float8 e4m3 weights with one float32 ``weight_scale`` per tensor, which multiplies the
stored element (``input_scale`` / ``k_scale`` / ``v_scale`` scale activations: dropped).

``exclude_modules`` lists the modules left unquantized (``fnmatch`` patterns, as modelopt
writes them: ``lm_head``, ``model.layers.*.mlp.gate``). The config's ``quant_algo``
picks the variant: ``FP8`` here, ``NVFP4`` in :mod:`ckptkit.quant.nvfp4`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.quant.grid import E4M3, GridScaled
from ckptkit.quant.method import Stored, register_method

ACTIVATION = (".input_scale", ".output_scale", ".k_scale", ".v_scale")
HF_QUANT_CONFIG = "hf_quant_config.json"  # a modelopt export's quantization, where config.json has none


class ModelOptFP8(GridScaled):
    """``quant_method: "modelopt"`` with ``quant_algo: "FP8"`` (per-tensor scales)."""

    activation_scales = ACTIVATION

    name = "modelopt"
    stored = E4M3
    skip_key = "exclude_modules"
    scale_dtypes = ("float32",)

    variants: ClassVar[dict[str, type[ModelOptFP8]]] = {}  # quant_algo -> its class

    @classmethod
    def for_config(cls, config: Mapping[str, Any], where: Path) -> ModelOptFP8:
        algo = fields(config).get("quant_algo")
        variant = cls.variants.get(algo) if isinstance(algo, str) else None
        if variant is None:
            raise CkptkitError(
                f"{where}: modelopt quant_algo {algo!r}: ckptkit reads {', '.join(cls.variants)}; nothing converted"
            )
        return variant(config, where)

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        given = fields(config)
        skip = given.get("exclude_modules") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise CkptkitError(f"{where}: quantization_config.exclude_modules must be a list of names")
        self.skip = skip

    def keeps_unquantized(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return any(fnmatch.fnmatchcase(module, m) for m in self.skip)

    def block_of(self, weight: Stored) -> tuple[int, int]:
        rows, cols = weight.shape[-2:]
        return rows, cols

    def block_rows(self) -> int:
        return 0  # one scale per tensor: any row order keeps it

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "block": "tensor", "stored": self.stored, "scales": "float32 per tensor"}


def hf_quant_config(folder: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` a modelopt export's ``hf_quant_config.json`` in ``folder``
    amounts to, as transformers writes it into ``config.json`` (its ``quantization`` fields,
    ``producer``, ``quant_method`` the producer's name), or None."""
    import json

    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CkptkitError(f"{path}: not readable JSON ({e})") from None
    producer = doc.get("producer") if isinstance(doc, dict) else None
    name = producer.get("name") if isinstance(producer, dict) else None
    if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict) or name != "modelopt":
        raise CkptkitError(f"{path}: not a modelopt export's quantization (producer modelopt, quantization)")
    return {"quant_method": name, "producer": producer, **doc["quantization"]}


def fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config's modelopt fields (nested under ``quantization`` in hf_quant_config.json's layout)."""
    nested = config.get("quantization")
    return nested if isinstance(nested, dict) else config


ModelOptFP8.variants["FP8"] = ModelOptFP8
register_method(ModelOptFP8)
