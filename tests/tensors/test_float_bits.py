"""numpy's conversions on raw bits give torch's bytes: every code of each one-byte dtype,
stored scales widened to float32, and float32 rounded to bfloat16 / float16 over random bit
patterns (NaNs with every payload, subnormals, ties, overflow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptkit.tensors import float_bits

EDGES = [
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x477FEFFF, 0x477FF000, 0x477FE000, 0x38800000,
    0x33800000, 0x33000000, 0x33000001, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x7FC00000, 0xFFC00000,
    0x7FF00000, 0xFFF00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0, 0x80000000,
]  # fmt: skip


def _random_floats(seed: int, n: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64, generator=g)
    edges = torch.tensor(EDGES, dtype=torch.int64)
    return torch.cat([bits, edges]).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("stored", ["float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
def test_every_byte_code_widens_as_torch_widens_it(stored: str) -> None:
    want = torch.arange(256, dtype=torch.uint8).view(getattr(torch, stored)).to(torch.float32)
    got = float_bits.widened(stored)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(torch.int32).numpy().view(np.uint32))


@pytest.mark.skipif(not float_bits.LIKE_TORCH, reason="numpy's rounding is checked against torch's on x86-64 only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_float32_rounds_to_torch_s_bits(dtype: str) -> None:
    for seed in (0, 1):
        x = _random_floats(seed)
        want = x.to(getattr(torch, dtype)).view(torch.int16 if dtype != "float32" else torch.int32).numpy()
        got = float_bits.rounded(x.numpy(), dtype)
        assert got.dtype == float_bits.ROUNDED[dtype]
        differ = got != want.view(got.dtype)
        assert not differ.any(), [hex(int(v)) for v in x.view(torch.int32).numpy().view(np.uint32)[differ][:5]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e8m0fnu"])
def test_stored_scales_widen_to_torch_s_float32(dtype: str) -> None:
    if dtype == "float8_e8m0fnu":
        t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(16, 16)
    else:
        t = _random_floats(2, 4096).reshape(-1, 2).to(getattr(torch, dtype))
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    got = float_bits.as_float32(raw, dtype, tuple(t.shape))
    assert got.shape == tuple(t.shape) and got.dtype == np.float32
    want = t.to(torch.float32).view(torch.int32).numpy().view(np.uint32)
    nan = np.isnan(got)
    assert np.array_equal(nan, np.isnan(t.to(torch.float32).numpy()))
    assert np.array_equal(got.view(np.uint32)[~nan], want[~nan])  # NaN payloads are never used: refused first


def test_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="no byte codes"):
        float_bits.widened("bfloat16")
    with pytest.raises(ValueError, match="no float32 view"):
        float_bits.as_float32(b"\0", "int8", (1,))
    with pytest.raises(ValueError, match="no rounding"):
        float_bits.rounded(np.zeros(1, np.float32), "float8_e4m3fn")
