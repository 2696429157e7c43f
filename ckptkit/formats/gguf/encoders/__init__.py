"""GGML block encoders, each the same bytes as ggml's ``quantize_row_<type>_ref`` (what
``llama-quantize`` runs when it is given no imatrix; for IQ4_NL its ``quantize_iq4_nl`` with
no weights), one module per type.

Every encoder does, over arrays of blocks, the float32 operations of the C reference in its
order (:mod:`~ckptkit.formats.gguf.encoders.common`): numpy, sums element by element over
element-major arrays; the scale searches (``make_qkx2_quants``, ``make_qx_quants``) are
ggml's loops compiled with numba (:mod:`~ckptkit.formats.gguf.encoders.jit`), many blocks
side by side. Each takes float32 values (a multiple of its block) and returns the blocks
``(n, SIZE)`` as uint8.
"""

from __future__ import annotations

from types import ModuleType

from ckptkit.formats.gguf.encoders import (
    iq4_nl,
    iq4_xs,
    q2_k,
    q3_k,
    q4_0,
    q4_1,
    q4_k,
    q5_0,
    q5_1,
    q5_k,
    q6_k,
    tq1_0,
    tq2_0,
)

ENCODERS: dict[str, ModuleType] = {
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q5_0": q5_0,
    "Q5_1": q5_1,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
    "TQ1_0": tq1_0,
    "TQ2_0": tq2_0,
}
