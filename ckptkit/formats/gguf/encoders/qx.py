"""ggml's ``make_qx_quants`` search (``rmse_type`` 1, given weights): a symmetric scale and
quants for each group, the best of 19 trial scales by weighted error, as Q6_K's reference and
the imatrix-weighted Q4_0 / Q5_0 / Q6_K use it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptkit.formats.gguf.encoders.common import GROUP_MAX_EPS, f32, first_abs_max, nearest_int, running_sum


def make_qx_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(k, nmax, x, L, 1, w)`` for every column of ``x`` and weights ``w``
    (k, m): the scales (m,) and the quants ``L`` (k, m), 0..2 * nmax - 1.

    The trial levels are float32 ``rint`` of ``iscale * x``, clipped, in one scratch array:
    where every ``x`` is finite, ``|iscale * x|`` is at most ``nmax + 1`` in each column that is
    not all (near) zero, where ggml's ``nearest_int`` is round-half-even too; the others'
    results are dropped. Values with a NaN or an infinity take :func:`_make_qx_quants_int`."""
    if not np.isfinite(x).all():
        return _make_qx_quants_int(x, w, nmax)
    vmax = first_abs_max(x.T)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    wx = w * x
    scratch = np.empty_like(x)
    lo, hi = f32(-nmax), f32(nmax - 1)

    def levels(iscale: np.ndarray) -> np.ndarray:
        np.multiply(iscale, x, out=scratch)
        np.rint(scratch, out=scratch)
        return np.clip(scratch, lo, hi, out=scratch)

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lf = levels(iscale)
        wl2 = w * lf
        wl2 *= lf  # (w * l) * l, as the C expression
        return running_sum(wx * lf), running_sum(wl2)

    with np.errstate(all="ignore"):
        return _search(fit, levels, vmax, zero, nmax)


def _search(fit: Any, levels: Any, vmax: np.ndarray, zero: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """The 19 trial scales of ``make_qx_quants`` given ``fit`` and ``levels`` of an iscale."""
    best_iscale = f32(-nmax) / vmax
    sumlx, suml2 = fit(best_iscale)
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(np.float32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(step)) / vmax
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    quants = np.asarray(levels(best_iscale)).astype(np.int32) + nmax
    return np.where(zero, f32(0), scale), np.where(zero, 0, quants)


def _make_qx_quants_int(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`make_qx_quants` with ggml's integer ``nearest_int`` (any values, NaN included)."""
    vmax = first_abs_max(x.T)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    wx = w * x

    def levels(iscale: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        return out

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lf = levels(iscale).astype(np.float32)
        return running_sum(wx * lf), running_sum(w * lf * lf)

    with np.errstate(all="ignore"):
        return _search(fit, levels, vmax, zero, nmax)
