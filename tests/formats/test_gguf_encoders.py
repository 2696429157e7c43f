"""ckptkit's GGML block encoders give the bytes of llama.cpp's own reference quantizers
(``quantize_row_<type>_ref`` of ``ggml-quants.c``, built from the pinned llama.cpp sources:
``ggml_reference``) on random rows and on the rows that stress them: zeros of both signs,
constants, huge and tiny magnitudes, subnormals, ranges over 60 decades, outliers, values
that land on rounding ties."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_reference import reference

from ckptkit.formats.gguf.encoders import ENCODERS

N = 64  # blocks per case


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = 256 * N
    normal = rng.standard_normal(n).astype(np.float32)
    return {
        "normal": normal,
        "zeros": np.zeros(n, np.float32),
        "negative zeros": -np.zeros(n, np.float32),
        "constant": np.full(n, 0.37, np.float32),
        "negative constant": np.full(n, -2.5, np.float32),
        "huge": normal * np.float32(1e30),
        "float32 max": np.where(normal < 0, np.float32(-3e38), np.float32(3e38)),
        "60 decades": (normal * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32),
        "subnormal": normal * np.float32(1e-39),
        "tiny": normal * np.float32(1e-20),
        "sparse": normal * (rng.random(n) < 0.05),
        "outliers": np.where(rng.random(n) < 0.01, np.float32(100), normal),
        "integers": rng.integers(-8, 8, n).astype(np.float32),
        "halves": rng.choice(np.array([-4, -2, -1, 0, 1, 2, 4], np.float32), n),
        "positive": rng.random(n).astype(np.float32),
        "negative": -rng.random(n).astype(np.float32),
        "bfloat16 values": (normal.view(np.uint32) & 0xFFFF0000).view(np.float32),
    }


CASES = _cases()


@pytest.mark.parametrize("kind", sorted(ENCODERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_encoder_gives_llama_cpp_reference_bytes(kind: str, case: str) -> None:
    x = CASES[case]
    with np.errstate(all="ignore"):
        got = ENCODERS[kind].encode(x)
    want = reference(kind, x)
    assert got.shape == want.shape == (x.size // ENCODERS[kind].BLOCK, ENCODERS[kind].SIZE)
    assert np.array_equal(got, want), f"blocks differ: {np.nonzero((got != want).any(axis=1))[0][:8]}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_q8_0_gives_llama_cpp_reference_bytes(case: str) -> None:
    """The Q8_0 that ``--dtype q8_0`` and the K mixes' fallbacks write (``quants.quantize_q8_0``)."""
    from ckptkit.formats.gguf.quants import quantize_q8_0

    x = CASES[case]
    with np.errstate(all="ignore"):
        got = quantize_q8_0(x.reshape(-1, 32))
    assert np.array_equal(got, reference("Q8_0", x))


def _non_finite() -> np.ndarray:
    rng = np.random.default_rng(2)
    n = 256 * N
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.01] = np.inf
    x[rng.random(n) < 0.01] = -np.inf
    x[rng.random(n) < 0.01] = np.nan
    return x


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K", "Q2_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_infinities_and_nans_give_the_reference_bytes(kind: str) -> None:
    """Values that are not finite go through ggml's integer ``nearest_int`` (the compiled
    searches, the IQ4 searches) and give ggml's bytes too."""
    x = _non_finite()
    with np.errstate(all="ignore"):
        got = ENCODERS[kind].encode(x)
    assert np.array_equal(got, reference(kind, x))


@pytest.mark.parametrize("kind", ["Q2_K", "Q4_K", "Q5_K"])
def test_every_case_in_one_tensor_gives_the_reference_bytes(kind: str) -> None:
    """Every case's blocks shuffled into one tensor, one of them infinite: more columns
    than ``make_qkx2_quants`` searches at a time, finite chunks and one that is not."""
    blocks = np.concatenate(list(CASES.values())).reshape(-1, 256)
    x = blocks[np.random.default_rng(3).permutation(len(blocks))].reshape(-1)
    x[-1000] = np.inf
    with np.errstate(all="ignore"):
        got = ENCODERS[kind].encode(x)
    assert np.array_equal(got, reference(kind, x))
