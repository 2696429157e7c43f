"""Quantization weighted by an importance matrix, as ggml's ``quantize_<type>`` does it when
``llama-quantize`` passes imatrix weights (the ``quantize_row_<type>_impl`` functions): per
type, a function of float32 rows ``(n, columns)`` and their imatrix weights ``(n, columns)``
giving the rows' blocks ``(n * columns / block, bytes)`` as uint8, the same bytes as ggml's.

A value's weight is its imatrix weight times ``sqrt(sigma2 + x * x)`` (``sigma2``: the row's
mean square for the 32-blocks, twice the super-block's for the K types); the scale searches
are ggml's ``make_qx_quants`` (symmetric types), ``make_qkx3_quants`` (types with a minimum:
the same search as ``make_qkx2_quants``) and ``make_qp_quants`` (the K types' sub-block
scales), in float32 in the C loops' order (:mod:`~ckptkit.formats.gguf.encoders.common`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ckptkit.formats.gguf.encoders.common import (
    GROUP_MAX_EPS,
    blocks_out,
    f32,
    fifth_bits,
    fp16,
    low_byte,
    nearest_int,
    nibbles,
    running_sum,
)
from ckptkit.formats.gguf.encoders.iq4_nl import encode as iq4_nl_encode
from ckptkit.formats.gguf.encoders.iq4_xs import encode as iq4_xs_encode
from ckptkit.formats.gguf.encoders.q2_k import pack as q2_k_pack
from ckptkit.formats.gguf.encoders.q3_k import pack as q3_k_pack
from ckptkit.formats.gguf.encoders.q4_k import pack as q4_k_pack
from ckptkit.formats.gguf.encoders.q5_k import pack as q5_k_pack
from ckptkit.formats.gguf.encoders.q6_k import encode as q6_k_encode
from ckptkit.formats.gguf.encoders.qkx2 import make_qkx2_quants, requantized
from ckptkit.formats.gguf.encoders.qx import make_qx_quants


def _row_weights(x: np.ndarray, qw: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The 32-block types' element-major blocks of ``x`` (block, n * blocks per row) and their
    weights ``qw * sqrt(sigma2 + x * x)``, ``sigma2`` the row's sum of squares over its length."""
    n, cols = x.shape
    with np.errstate(all="ignore"):
        sigma2 = running_sum(np.ascontiguousarray((x * x).T)) / f32(cols)
        weight = qw.astype(np.float32) * np.sqrt(sigma2[:, None] + x * x)
    xb = np.ascontiguousarray(x.reshape(-1, block).T)
    wb = np.ascontiguousarray(weight.reshape(-1, block).T)
    return xb, wb


def make_qp_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qp_quants(k, nmax, x, L, w)`` for every column of ``x`` and weights ``w`` (k, m):
    the scales (m,) and quants ``L`` (k, m) as stored in ``uint8_t`` (a negative one wraps)."""
    top = np.zeros(x.shape[1], np.float32)
    for row in x:
        top = np.where(top > row, top, row)  # MAX(max, x[i])
    zero = top < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = f32(nmax) / top
        lq = low_byte(nearest_int(iscale * x)).astype(np.float32)
        scale = f32(1) / iscale
        diff = x - scale * lq
        best = running_sum(w * diff * diff)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            iscale_is = (f32(0.1) * f32(step) + f32(nmax)) / top
            scale_is = f32(1) / iscale_is
            diff = x - scale_is * np.minimum(nmax, nearest_int(iscale_is * x)).astype(np.float32)
            mse = running_sum(w * diff * diff)
            iscale = np.where(mse < best, iscale_is, iscale)
            best = np.where(mse < best, mse, best)
        lint = np.minimum(nmax, nearest_int(iscale * x))
        lf = lint.astype(np.float32)
        sumlx, suml2 = running_sum(w * x * lf), running_sum(w * lf * lf)
        stored = low_byte(lint)
        for _ in range(5):
            for i in range(x.shape[0]):
                xi, wi, li = x[i], w[i], stored[i].astype(np.float32)
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                new = np.minimum(nmax, nearest_int(xi * sl2 / slx))
                nf = new.astype(np.float32)
                slx2 = slx + wi * xi * nf
                sl22 = sl2 + wi * nf * nf
                take = (slx > 0) & (sl2 > 0) & (new != stored[i]) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                stored[i] = np.where(take, low_byte(new), stored[i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    return np.where(zero, f32(0), scale), np.where(zero, 0, stored)


def _k_weights(
    x: np.ndarray, qw: np.ndarray, size: int = 32, block: int = 256, factor: int = 2
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The element-major sub-blocks of ``size`` of ``x`` (size, n * blocks), their weights
    ``qw * sqrt(sigma2 + x * x)`` (``sigma2``: ``factor`` times the ``block``'s mean square)
    and the weights' sum per sub-block ``(block / size, blocks)``."""
    blocks = x.reshape(-1, block)
    with np.errstate(all="ignore"):
        sigma2 = f32(factor) * running_sum(np.ascontiguousarray((blocks * blocks).T)) / f32(block)
        weight = qw.reshape(-1, block).astype(np.float32) * np.sqrt(sigma2[:, None] + blocks * blocks)
    sub = np.ascontiguousarray(blocks.reshape(-1, size).T)
    wsub = np.ascontiguousarray(weight.reshape(-1, size).T)
    sw = running_sum(wsub).reshape(-1, block // size).T
    return sub, wsub, np.ascontiguousarray(sw)


def _k_quant(x: np.ndarray, qw: np.ndarray, nmax: int, cap: bool) -> tuple[np.ndarray, ...]:
    """``quantize_row_q{4,5}_K_impl`` up to the bit packing: the float16 scales (n,), the packed
    6-bit scales (n, 12) and the quants (n, 256); ``cap``: the scales held at 63 (Q5_K)."""
    sub, wsub, sw = _k_weights(x, qw)
    scales, mins, quants = make_qkx2_quants(sub, wsub, nmax, -0.9, 0.05, 36)
    d_block, ls = make_qp_quants(np.ascontiguousarray(scales.reshape(-1, 8).T), sw, 63)
    m_block, lm = make_qp_quants(np.ascontiguousarray(mins.reshape(-1, 8).T), sw, 63)
    ls, lm = ls.T, lm.T
    if cap:
        ls, lm = np.minimum(63, ls), np.minimum(63, lm)
    d, dmin = fp16(d_block), fp16(m_block)
    packed, quants = requantized(sub, quants, d, dmin, ls, lm, nmax)
    return d, dmin, packed, quants


def q4_k(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_impl``: Q4_K blocks ``(n, 144)``."""
    return q4_k_pack(*_k_quant(x, qw, 15, False))


def q5_k(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_K_impl``: Q5_K blocks ``(n, 176)``."""
    return q5_k_pack(*_k_quant(x, qw, 31, True))


def q6_k(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q6_K_impl``: Q6_K blocks ``(n, 210)`` (the raw imatrix weights)."""
    return q6_k_encode(x, qw)


def q2_k(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q2_K_impl``: Q2_K blocks ``(n, 84)`` (``sigma2`` the super-block's mean
    square, ``make_qkx3_quants`` per 16, ``make_qp_quants`` of the scales and minimums to 15)."""
    sub, wsub, sw = _k_weights(x, qw, size=16, factor=1)
    scales, mins, quants = make_qkx2_quants(sub, wsub, 3, -0.9, 0.05, 36)
    d_block, ls = make_qp_quants(np.ascontiguousarray(scales.reshape(-1, 16).T), sw, 15)
    m_block, lm = make_qp_quants(np.ascontiguousarray(mins.reshape(-1, 16).T), sw, 15)
    return q2_k_pack(sub, quants, low_byte(ls.T | (lm.T << 4)), fp16(d_block), fp16(m_block))


def q3_k(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q3_K_impl``: Q3_K blocks ``(n, 110)`` (``make_qx_quants`` per 16, then of
    the 16 scales to 6 bits, weighted by the sub-blocks' weight sums)."""
    sub, wsub, sw = _k_weights(x, qw, size=16)
    scales, quants = make_qx_quants(sub, wsub, 4)
    d_block, ls = make_qx_quants(np.ascontiguousarray(scales.reshape(-1, 16).T), sw, 32)
    return q3_k_pack(sub, quants, ls.T, fp16(d_block))


def iq4_nl(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_iq4_nl`` with weights: IQ4_NL blocks ``(n, 18)`` (``sigma2`` per block of 32)."""
    _, wsub, _ = _k_weights(x, qw, block=32)
    return iq4_nl_encode(x, wsub)


def iq4_xs(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_iq4_xs`` with weights: IQ4_XS blocks ``(n, 136)``."""
    _, wsub, _ = _k_weights(x, qw)
    return iq4_xs_encode(x, wsub)


def q4_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_0_impl``: Q4_0 blocks ``(n, 18)``."""
    xb, wb = _row_weights(x, qw, 32)
    d, q = make_qx_quants(xb, wb, 8)
    return blocks_out(fp16(d), nibbles(q[:16].T, q[16:].T))


def q5_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_0_impl``: Q5_0 blocks ``(n, 22)``."""
    xb, wb = _row_weights(x, qw, 32)
    d, q = make_qx_quants(xb, wb, 16)
    return blocks_out(fp16(d), fifth_bits(q.T), nibbles(q[:16].T, q[16:].T))


def _with_min(x: np.ndarray, qw: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xb, wb = _row_weights(x, qw, 32)
    scale, the_min, q = make_qkx2_quants(xb, wb, nmax, -0.9, 0.05, 36)
    return fp16(scale), fp16(-the_min), q.T


def q4_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_1_impl``: Q4_1 blocks ``(n, 20)``."""
    d, m, q = _with_min(x, qw, 15)
    return blocks_out(d, m, nibbles(q[:, :16], q[:, 16:]))


def q5_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_1_impl``: Q5_1 blocks ``(n, 24)``."""
    d, m, q = _with_min(x, qw, 31)
    return blocks_out(d, m, fifth_bits(q), nibbles(q[:, :16], q[:, 16:]))


WEIGHTED: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
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
}
UNWEIGHTED = ("F32", "F16", "BF16", "Q8_0", "TQ1_0", "TQ2_0")
"""The types ggml quantizes the same with or without imatrix weights (``quantize_q8_0`` and
``quantize_tq{1,2}_0`` ignore them)."""
