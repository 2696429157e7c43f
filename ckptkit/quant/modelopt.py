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
        algo = _fields(config).get("quant_algo")
        variant = cls.variants.get(algo) if isinstance(algo, str) else None
        if variant is None:
            raise CkptkitError(
                f"{where}: modelopt quant_algo {algo!r}: ckptkit reads {', '.join(cls.variants)}; nothing converted"
            )
        return variant(config, where)

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        fields = _fields(config)
        skip = fields.get("exclude_modules") or []
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


def _fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config's modelopt fields (nested under ``quantization`` in hf_quant_config.json's layout)."""
    nested = config.get("quantization")
    return nested if isinstance(nested, dict) else config


ModelOptFP8.variants["FP8"] = ModelOptFP8
register_method(ModelOptFP8)
