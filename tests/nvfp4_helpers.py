"""modelopt NVFP4 written out for the tests: the value of e2m1 codes, modelopt's
dequantization formula, and llama.cpp's converter's ``_nvfp4_pack`` taken out of its source."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """The value of 4-bit e2m1 codes from their bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = 1 - 2 * ((code >> 3) & 1).float()
    exponent, mantissa = ((code >> 1) & 3).float(), (code & 1).float()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.exp2(exponent - 1) * (1 + mantissa / 2))
    return sign * magnitude


def modelopt_dequantized(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 values: byte j holds values 2j (low nibble) and 2j + 1 (high nibble); each
    block of 16 times ``float32(scale) * scale_2``."""
    rows = packed.shape[0]
    values = torch.empty(rows, packed.shape[1] * 2)
    values[:, 0::2], values[:, 1::2] = e2m1(packed & 0x0F), e2m1(packed >> 4)
    per_block = scale.float() * scale_2.float()
    return (values.reshape(rows, -1, 16) * per_block.unsqueeze(-1)).reshape(rows, -1)


def llama_cpp_pack(llama_cpp: Path) -> Callable[..., Any]:
    """llama.cpp's converter's ``ModelBase._nvfp4_pack``, taken out of its source (importing
    the converter's package takes half a minute)."""
    tree = ast.parse((llama_cpp / "conversion" / "base.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_nvfp4_pack")
    fn.decorator_list = []
    scope: dict[str, Any] = {"torch": torch, "np": np, "Tensor": torch.Tensor}
    exec(compile(ast.Module([fn], []), "conversion/base.py", "exec"), scope)
    return scope["_nvfp4_pack"]  # type: ignore[no-any-return]
