"""Dtype names. Metadata carries names (``"bfloat16"``), so reading headers needs no torch;
torch dtypes appear only where tensors are materialised."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# safetensors header code -> dtype name (torch's spelling without the ``torch.`` prefix)
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
SAFETENSORS_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
}  # fmt: skip
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
CAST_TARGETS = ("bfloat16", "float16", "float32")
# What users type for a dtype, and the name they mean (the CLI's did-you-mean).
DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32", "int8": "q8_0",
    "q8": "q8_0", "8bit": "q8_0",
}  # fmt: skip


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``) -> ``"bfloat16"``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def to_torch(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order (a view of its memory where it is contiguous)."""
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
