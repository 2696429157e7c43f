"""ggml's ``make_qx_quants`` search (``rmse_type`` 1, given weights): a symmetric scale and
quants for each group, the best of 19 trial scales by weighted error, as Q6_K's reference and
the imatrix-weighted Q4_0 / Q5_0 / Q6_K use it."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import GROUP_MAX_EPS
from ckptkit.formats.gguf.encoders.jit import LANES, kernel, level

TRIALS = np.array([s for s in range(-9, 10) if s != 0], np.float32)  # the ``is`` of the trial scales


def make_qx_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(k, nmax, x, L, 1, w)`` for every column of ``x`` and weights ``w``
    (k, m): the scales (m,) and the quants ``L`` (k, m), 0..2 * nmax - 1, compiled
    (:func:`_make_qx_quants`)."""
    m = x.shape[1]
    scales = np.empty(m, np.float32)
    quants = np.empty(x.shape, np.int32)
    xc, wc = (np.ascontiguousarray(a, dtype=np.float32) for a in (x, w))
    _make_qx_quants(xc, wc, nmax, TRIALS, scales, quants)
    return scales, quants


@kernel
def _make_qx_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, trials: np.ndarray, scales: np.ndarray, quants: np.ndarray
) -> None:  # pragma: no cover (compiled)
    """ggml's loops for the columns (groups) of ``x`` and ``w``, ``LANES`` at a time, each
    column's sums in its C order, into ``scales`` and the columns of ``quants``. Each column's
    quants are those of its best trial's ``iscale``, made again at the end; a column whose
    largest magnitude is under ``GROUP_MAX_EPS`` gets scale 0 and quants 0."""
    k, m = x.shape
    lo, hi, top = np.float32(-nmax), np.float32(nmax - 1), np.float32(nmax)
    st = np.empty((7, LANES), np.float32)
    vmax, amax, iscale, best_iscale, scale, best, sumlx = st
    suml2 = np.empty(LANES, np.float32)
    xs, ws = np.empty((k, LANES), np.float32), np.empty((k, LANES), np.float32)
    for b0 in range(0, m, LANES):
        c = min(LANES, m - b0)
        for i in range(k):  # the chunk copied: indices from 0 compile to vector loads
            for j in range(c):
                xs[i, j] = x[i, b0 + j]
                ws[i, j] = w[i, b0 + j]
        for j in range(c):
            vmax[j] = 0
            amax[j] = 0
        for i in range(k):
            for j in range(c):
                ax = abs(xs[i, j])
                vmax[j] = xs[i, j] if ax > amax[j] else vmax[j]
                amax[j] = ax if ax > amax[j] else amax[j]
        for t in range(trials.size + 1):
            for j in range(c):
                iscale[j] = -top / vmax[j] if t == 0 else -(top + np.float32(0.1) * trials[t - 1]) / vmax[j]
                sumlx[j] = 0
                suml2[j] = 0
            for i in range(k):
                for j in range(c):
                    q = level(iscale[j] * xs[i, j], lo, hi)
                    sumlx[j] += ws[i, j] * xs[i, j] * q
                    suml2[j] += ws[i, j] * q * q
            for j in range(c):
                if t == 0:
                    best_iscale[j] = iscale[j]
                    scale[j] = sumlx[j] / suml2[j] if suml2[j] != 0 else np.float32(0)
                    best[j] = scale[j] * sumlx[j]
                elif suml2[j] > 0 and sumlx[j] * sumlx[j] > best[j] * suml2[j]:
                    best_iscale[j] = iscale[j]
                    scale[j] = sumlx[j] / suml2[j]
                    best[j] = scale[j] * sumlx[j]
        for i in range(k):
            for j in range(c):
                q = level(best_iscale[j] * xs[i, j], lo, hi)
                quants[i, b0 + j] = 0 if amax[j] < GROUP_MAX_EPS else np.int32(q) + nmax
        for j in range(c):
            scales[b0 + j] = 0 if amax[j] < GROUP_MAX_EPS else scale[j]
