"""Mistral's FP8 consolidated checkpoints: ``params.json`` says ``"quantization":
{"qformat_weight": "fp8_e4m3", ...}`` and each quantized linear weight is ``float8_e4m3fn``
with a per-tensor ``qscale_weight`` beside it (``qscale_act`` scales activations: dropped).
The scale multiplies (vLLM reads ``qscale_weight`` as a per-tensor ``weight_scale``).

ckptkit reads and dequantizes them; no other format has a place for these scales under their
names, so they are written dequantized everywhere (see :attr:`QuantMethod.keepable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.quant.grid import E4M3, GridScaled
from ckptkit.quant.method import Stored, register_method

METHOD = "mistral-qscale"  # the quant_method ckptkit gives params.json's "quantization"
SCALE = "qscale_weight"
ACTIVATION = ".qscale_act"


def mistral_config(params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` params.json's ``quantization`` amounts to, or None."""
    q = params.get("quantization")
    if not (isinstance(q, dict) and "qformat_weight" in q):
        return None
    return {**q, "quant_method": METHOD}


class MistralFP8(GridScaled):
    """params.json ``qformat_weight: "fp8_e4m3"``: per-tensor ``qscale_weight``."""

    name = METHOD
    stored = E4M3
    keepable = False

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        super().__init__(config, where)
        fmt = config.get("qformat_weight")
        if fmt != "fp8_e4m3":
            raise CkptkitError(f"{where}: quantization.qformat_weight {fmt!r}: ckptkit reads 'fp8_e4m3'")

    def scale_name(self, weight: str) -> str:
        return weight.removesuffix("weight") + SCALE

    def weight_of_scale(self, name: str) -> str | None:
        return name.removesuffix(SCALE) + "weight" if name.endswith("." + SCALE) else None

    def is_activation_scale(self, name: str) -> bool:
        return name.endswith(ACTIVATION)

    def keeps_unquantized(self, name: str) -> bool:
        return False

    def block_of(self, weight: Stored) -> tuple[int, int]:
        rows, cols = weight.shape[-2:]
        return rows, cols

    def block_rows(self) -> int:
        return 0  # one scale per tensor

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "block": "tensor", "stored": self.stored, "scales": "per tensor (qscale_weight)"}


register_method(MistralFP8)
