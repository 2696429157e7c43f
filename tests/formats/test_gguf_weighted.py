"""Imatrix-weighted quantization (``weighted.WEIGHTED``) gives the bytes of ggml's own
``quantize_<type>`` called with imatrix weights, as llama-quantize calls it (``ggml_reference``:
``ggml-quants.c`` compiled without FMA contraction), on the encoder tests' value cases."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_reference import weighted_reference
from test_gguf_encoders import CASES

from ckptkit.formats.gguf.weighted import WEIGHTED

COLUMNS = 512


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    spread = rng.uniform(0.01, 40.0, COLUMNS).astype(np.float32)
    return {"spread": spread, "some zero": np.where(rng.random(COLUMNS) < 0.2, np.float32(0), spread)}


WEIGHTS = _weights()


@pytest.mark.parametrize("kind", sorted(WEIGHTED))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_weighted_gives_ggml_bytes(kind: str, case: str, weights: str) -> None:
    x = CASES[case].reshape(-1, COLUMNS)
    w = WEIGHTS[weights]
    with np.errstate(all="ignore"):
        got = WEIGHTED[kind](x, np.broadcast_to(w, x.shape))
    want = weighted_reference(kind, x, w)
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"blocks differ: {np.nonzero((got != want).any(axis=1))[0][:8]}"
