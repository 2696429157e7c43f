"""Meta Llama 2's ``rope.freqs`` as bfloat16 bytes, computed without torch.

Meta computes it as ``1.0 / (theta ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))``
in float32, then casts to bfloat16. Each float32 step is emulated here: the division and
the reciprocal are correctly rounded in float32 (and a correctly rounded float64 result
rounded to float32 is the same value), and the float32 cast of a float64 ``pow`` is
within an ULP of torch's float32 ``pow``. That difference can change the bfloat16 result
only when the float32 reciprocal lies near a bfloat16 rounding midpoint; for such values
torch itself computes the tensor.
"""

from __future__ import annotations

import struct

NEAR_MIDPOINT_ULPS = 8  # float32 ULPs around a bfloat16 midpoint where torch's pow decides


FLT_MAX = 3.4028234663852886e38  # the largest finite float32


def f32(x: float) -> float:
    """``x`` rounded to float32 (nearest, ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bf16_bits(bits: int) -> int:
    """The bfloat16 nearest to the float32 with these bits (ties to even); finite inputs."""
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def near_bf16_midpoint(bits: int, ulps: int = NEAR_MIDPOINT_ULPS) -> bool:
    """Whether float32 ``bits`` lie within ``ulps`` of halfway between two bfloat16 values."""
    return abs((bits & 0xFFFF) - 0x8000) <= ulps


def emulated_f32(head_dim: int, theta: float) -> list[float]:
    """The float32 values before the bfloat16 cast, step by step as torch computes them."""
    base = f32(theta)
    exponents = [f32(f32(float(i)) / f32(float(head_dim))) for i in range(0, head_dim, 2)][: head_dim // 2]
    return [f32(1.0 / f32(base**x)) for x in exponents]


def rope_freqs_bytes(head_dim: int, theta: float) -> bytes:
    """The bytes of Meta's bfloat16 ``rope.freqs`` (little-endian), torch only near midpoints
    (and for a theta float32 cannot hold, where torch's overflow rules decide)."""
    if not 0.0 < theta <= FLT_MAX:
        return torch_rope_freqs_bytes(head_dim, theta)
    bits = [f32_bits(v) for v in emulated_f32(head_dim, theta)]
    if any(near_bf16_midpoint(b) for b in bits):
        return torch_rope_freqs_bytes(head_dim, theta)
    return struct.pack(f"<{len(bits)}H", *(bf16_bits(b) for b in bits))


def torch_rope_freqs_bytes(head_dim: int, theta: float) -> bytes:
    """Meta's expression, evaluated by torch."""
    import torch

    from ckptkit.tensors.dtypes import tensor_bytes

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    return bytes(tensor_bytes(freqs.to(torch.bfloat16)))
