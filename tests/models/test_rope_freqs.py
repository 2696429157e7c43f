"""Meta Llama 2's ``rope.freqs`` computed without torch is bitwise what Meta's torch
expression gives, and a conversion to Meta whose only tensor work is that (or carrying it
back from a sidecar) runs with torch imports blocked and writes the same bytes."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats.base import ORIGIN_FILE
from ckptkit.formats.safetensors_io import SafetensorsWriter
from ckptkit.formats.torch_writer import TorchPickleWriter
from ckptkit.models.rope_freqs import (
    NEAR_MIDPOINT_ULPS,
    bf16_bits,
    emulated_f32,
    f32_bits,
    near_bf16_midpoint,
    rope_freqs_bytes,
)

from conftest import FIXTURES, assert_same_files

THETAS = [10000.0, 500000.0, 1e6, 12345.6, 98765.4321, 3.5] + [1e4 * k for k in (2, 3, 7, 25, 100)]


def meta_rope_freqs(head_dim: int, theta: float) -> torch.Tensor:
    """Meta's own expression (llama/model.py's precompute_freqs_cis), cast as its checkpoints store it."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    return freqs.to(torch.bfloat16)


def bf16_words(data: bytes) -> torch.Tensor:
    """Little-endian bfloat16 bytes as int16 words (compared with a torch tensor's ``view(torch.int16)``)."""
    return torch.tensor(struct.unpack(f"<{len(data) // 2}h", data), dtype=torch.int16)


def test_torch_free_rope_freqs_equal_meta_expression_over_a_grid() -> None:
    near_ties = 0
    for theta in THETAS:
        for head_dim in range(2, 513, 2):
            expected = meta_rope_freqs(head_dim, theta).view(torch.int16)
            assert torch.equal(bf16_words(rope_freqs_bytes(head_dim, theta)), expected), (head_dim, theta)
            near_ties += any(near_bf16_midpoint(f32_bits(v)) for v in emulated_f32(head_dim, theta))
    assert near_ties > 0  # the torch fallback ran, and matched too


@settings(max_examples=200, deadline=None)
@given(head_dim=st.integers(1, 1024), theta=st.floats(1.5, 1e8, allow_nan=False))
def test_torch_free_rope_freqs_equal_meta_expression(head_dim: int, theta: float) -> None:
    got = bf16_words(rope_freqs_bytes(head_dim, theta))
    assert torch.equal(got, meta_rope_freqs(head_dim, theta).view(torch.int16))


# Past the largest float32: 3.4028235e38 still rounds to it (finite frequencies), the others overflow.
@pytest.mark.parametrize("theta", [3.4028235e38, 3.5e38, 1e39, float("inf")])
@pytest.mark.parametrize("head_dim", [2, 64, 128])
def test_rope_freqs_for_a_theta_beyond_float32_equal_meta_expression(head_dim: int, theta: float) -> None:
    """A theta beyond float32's largest value: the bytes are what Meta's torch expression gives."""
    got = bf16_words(rope_freqs_bytes(head_dim, theta))
    assert torch.equal(got, meta_rope_freqs(head_dim, theta).view(torch.int16))


def test_emulated_float32_steps_are_within_two_ulps_of_torch() -> None:
    """The margin the near-midpoint detector keeps (NEAR_MIDPOINT_ULPS) covers the measured
    disagreement of torch's float32 pow with a correctly rounded one."""
    worst = 0
    for theta in (10000.0, 500000.0, 12345.6):
        for head_dim in range(2, 513, 2):
            ref = (1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))).view(torch.int32).tolist()
            mine = [f32_bits(v) for v in emulated_f32(head_dim, theta)]
            worst = max(worst, *(abs(a - (b & 0xFFFFFFFF)) for a, b in zip(mine, ref, strict=True)))
    assert worst <= 2 < NEAR_MIDPOINT_ULPS


def test_usual_llama_head_dims_and_thetas_need_no_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from ckptkit.models.rope_freqs import rope_freqs_bytes\n"
        "for hd in (64, 80, 96, 128):\n"
        "    for theta in (10000.0, 500000.0, 1e6):\n"
        "        assert len(rope_freqs_bytes(hd, theta)) == hd\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bf16_rounding_matches_torch_including_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F000000, (20000,), generator=gen, dtype=torch.int64)
    bits = torch.cat([bits, (bits[:2000] & ~0xFFFF) | 0x8000, (bits[:2000] & ~0x1FFFF) | 0x8000])  # exact ties
    values = bits.to(torch.int32).view(torch.float32)
    expected = values.to(torch.bfloat16).view(torch.int16).tolist()
    assert [bf16_bits(b) for b in bits.tolist()] == [e & 0xFFFF for e in expected]


def test_near_midpoint_detector_on_constructed_values() -> None:
    one_and_half_bf16_ulp = 0x3F808000  # 1 + 2**-8: halfway between two bfloat16 values
    for delta in range(-NEAR_MIDPOINT_ULPS, NEAR_MIDPOINT_ULPS + 1):
        assert near_bf16_midpoint(one_and_half_bf16_ulp + delta)
    assert not near_bf16_midpoint(one_and_half_bf16_ulp + NEAR_MIDPOINT_ULPS + 1)
    assert not near_bf16_midpoint(one_and_half_bf16_ulp - NEAR_MIDPOINT_ULPS - 1)
    assert not near_bf16_midpoint(struct.unpack("<I", struct.pack("<f", 1.0))[0])


def test_writers_write_bytes_like_write(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    entries = [("a", "float32", (3, 4)), ("b", "float32", (3, 4))]
    st_writer = SafetensorsWriter(tmp_path / "x.safetensors", entries, {"format": "pt"})
    pth_writer = TorchPickleWriter(tmp_path / "x.pth", entries)
    for w in (st_writer, pth_writer):
        w.write("a", t)
        w.write_bytes("b", t.numpy().tobytes())
        with pytest.raises(ValueError, match="b: 4 bytes"):
            w.write_bytes("b", b"1234")
        w.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("a"), t) and torch.equal(f.get_tensor("b"), t)
    with zipfile.ZipFile(tmp_path / "x.pth") as z:
        assert z.testzip() is None  # every record's CRC-32 is right
    loaded = torch.load(tmp_path / "x.pth", weights_only=True)
    assert torch.equal(loaded["a"], t) and torch.equal(loaded["b"], t)


def convert_without_torch(src: Path, dst: Path, to: str) -> None:
    """``ckptkit convert`` in a subprocess where ``import torch`` fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # Python's way of making an import fail
        "from ckptkit.cli import app\n"
        f"sys.argv = ['ckptkit', 'convert', {str(src)!r}, {str(dst)!r}, '--to', {to!r}, '--quiet']\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama2_hf_to_meta_runs_without_torch(tmp_path: Path) -> None:
    convert_without_torch(FIXTURES / "hf" / "llama2", tmp_path / "blocked", "meta")
    convert(FIXTURES / "hf" / "llama2", tmp_path / "normal", ConvertOptions("meta"))
    assert_same_files(tmp_path / "blocked", tmp_path / "normal")
    sd = torch.load(tmp_path / "blocked" / "consolidated.00.pth", weights_only=True)
    assert torch.equal(sd["rope.freqs"].view(torch.int16), meta_rope_freqs(16, 10000.0).view(torch.int16))


def test_llama2_meta_hf_meta_round_trip_carries_recorded_rope_freqs_without_torch(tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / "llama2", tmp_path / "hf", ConvertOptions("hf"))
    convert_without_torch(tmp_path / "hf", tmp_path / "blocked", "meta")
    convert(tmp_path / "hf", tmp_path / "normal", ConvertOptions("meta"))
    assert_same_files(tmp_path / "blocked", tmp_path / "normal")
    original = torch.load(FIXTURES / "meta" / "llama2" / "consolidated.00.pth", weights_only=True)
    back = torch.load(tmp_path / "blocked" / "consolidated.00.pth", weights_only=True)
    assert list(back) == list(original)
    assert all(torch.equal(back[k].view(torch.uint8), original[k].view(torch.uint8)) for k in original)


def test_recorded_rope_freqs_are_carried_as_recorded_not_regenerated(tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / "llama2", tmp_path / "hf", ConvertOptions("hf"))
    sidecar = tmp_path / "hf" / ORIGIN_FILE
    doc = json.loads(sidecar.read_text())
    recorded = doc["origin"]["unused"]["rope.freqs"]
    marked = base64.b64decode(recorded["data"])[::-1]  # bytes no generator would give
    recorded["data"] = base64.b64encode(marked).decode()
    sidecar.write_text(json.dumps(doc))
    convert_without_torch(tmp_path / "hf", tmp_path / "meta", "meta")
    got = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)["rope.freqs"]
    assert got.contiguous().view(torch.uint8).numpy().tobytes() == marked
