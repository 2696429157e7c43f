"""What Q2_K, Q4_K and Q5_K share: ggml's ``make_qkx2_quants`` search for each sub-block's
scale and minimum, and the super-block step of ``quantize_row_q{4,5}_K_ref`` (6-bit scales
and minimums under two float16 super-scales, then the quants again)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import f32, fp16, low_byte, nearest_int, running_sum
from ckptkit.formats.gguf.encoders.jit import LANES, kernel, level
from ckptkit.formats.gguf.encoders.jit import nearest_int as nearest_int_1

SUB = 32


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)`` for
    every column of ``x`` and weights ``w`` (n, m): the scales and minimums (m,) and the
    quants ``L`` (n, m), compiled (:func:`_make_qkx2_quants`)."""
    m = x.shape[1]
    scales, mins = np.empty(m, np.float32), np.empty(m, np.float32)
    quants = np.empty(x.shape, np.int32)
    xc, wc = (np.ascontiguousarray(a, dtype=np.float32) for a in (x, w))
    _make_qkx2_quants(xc, wc, nmax, f32(rmin), f32(rdelta), nstep, use_mad, scales, mins, quants)
    return scales, mins, quants


@kernel
def _make_qkx2_quants(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: np.float32,
    rdelta: np.float32,
    nstep: int,
    use_mad: bool,
    scales: np.ndarray,
    mins: np.ndarray,
    quants: np.ndarray,
) -> None:  # pragma: no cover (compiled)
    """ggml's loops for the columns (blocks) of ``x`` and ``w``, ``LANES`` at a time, each
    column's sums in its C order, into ``scales``, ``mins`` and the columns of ``quants``.
    Each column's quants are those of its best trial's ``(iscale, min)``, made again at the
    end; a column where ``max == min`` takes ggml's early return."""
    n, m = x.shape
    top, zero = np.float32(nmax), np.float32(0)
    st = np.empty((12, LANES), np.float32)
    lo, hi, sum_w, sum_x, scale, best, iscale, best_iscale, best_lo, s_l, s_l2, s_xl = st
    tr = np.empty((4, LANES), np.float32)
    this_scale, this_min, cur, det = tr
    aux, xs, ws = np.empty((n, LANES), np.float32), np.empty((n, LANES), np.float32), np.empty((n, LANES), np.float32)
    for b0 in range(0, m, LANES):
        c = min(LANES, m - b0)
        for i in range(n):  # the chunk copied: indices from 0 compile to vector loads
            for j in range(c):
                xs[i, j] = x[i, b0 + j]
                ws[i, j] = w[i, b0 + j]
        for j in range(c):
            lo[j] = xs[0, j]
            hi[j] = xs[0, j]
            sum_w[j] = ws[0, j]
            sum_x[j] = ws[0, j] * xs[0, j]
        for i in range(1, n):
            for j in range(c):
                v = xs[i, j]
                lo[j] = v if v < lo[j] else lo[j]
                hi[j] = v if v > hi[j] else hi[j]
                sum_w[j] += ws[i, j]
                sum_x[j] += ws[i, j] * v
        for j in range(c):
            lo[j] = np.float32(0) if lo[j] > 0 else lo[j]
            iscale[j] = top / (hi[j] - lo[j])
            scale[j] = np.float32(1) / iscale[j]
            best_iscale[j] = iscale[j]
            best_lo[j] = lo[j]
            best[j] = 0
        for i in range(n):
            for j in range(c):
                q = level(iscale[j] * (xs[i, j] - lo[j]), zero, top)
                diff = scale[j] * q + lo[j] - xs[i, j]
                best[j] += ws[i, j] * (abs(diff) if use_mad else diff * diff)
        for step in range(nstep + 1 if nstep >= 1 else 0):
            for j in range(c):
                iscale[j] = (rmin + rdelta * np.float32(step) + top) / (hi[j] - lo[j])
                s_l[j] = 0
                s_l2[j] = 0
                s_xl[j] = 0
            for i in range(n):
                for j in range(c):
                    q = level(iscale[j] * (xs[i, j] - lo[j]), zero, top)
                    aux[i, j] = q
                    wl = ws[i, j] * q
                    s_l[j] += wl
                    s_l2[j] += wl * q
                    s_xl[j] += wl * xs[i, j]
            for j in range(c):
                det[j] = sum_w[j] * s_l2[j] - s_l[j] * s_l[j]
                clipped = (s_l2[j] * sum_x[j] - s_l[j] * s_xl[j]) / det[j] > 0
                this_scale[j] = s_xl[j] / s_l2[j] if clipped else (sum_w[j] * s_xl[j] - sum_x[j] * s_l[j]) / det[j]
                this_min[j] = 0 if clipped else (s_l2[j] * sum_x[j] - s_l[j] * s_xl[j]) / det[j]
                cur[j] = 0
            for i in range(n):
                for j in range(c):
                    diff = this_scale[j] * aux[i, j] + this_min[j] - xs[i, j]
                    cur[j] += ws[i, j] * (abs(diff) if use_mad else diff * diff)
            for j in range(c):
                if det[j] > 0 and cur[j] < best[j]:
                    best[j] = cur[j]
                    scale[j] = this_scale[j]
                    best_iscale[j] = iscale[j]
                    best_lo[j] = lo[j]
                    lo[j] = this_min[j]
        for i in range(n):
            for j in range(c):
                quants[i, b0 + j] = max(0, min(nmax, nearest_int_1(best_iscale[j] * (x[i, b0 + j] - best_lo[j]))))
        for j in range(c):
            flat_min = x[0, b0 + j]
            for i in range(1, n):
                flat_min = x[i, b0 + j] if x[i, b0 + j] < flat_min else flat_min
            flat_min = np.float32(0) if flat_min > 0 else flat_min
            if hi[j] == flat_min:
                scale[j] = 0
                lo[j] = flat_min
                for i in range(n):
                    quants[i, b0 + j] = 0
            scales[b0 + j] = scale[j]
            mins[b0 + j] = -lo[j]


def super_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The Q4_K / Q5_K steps of ``x`` (n, 256) up to the bit packing: the float16 scale and
    minimum scale (n,), the 12 bytes of packed 6-bit scales and minimums (n, 12) and the
    quants (n, 256), 0..nmax."""
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 8, SUB).T)  # (32, n * 8): element-major sub-blocks
    with np.errstate(all="ignore"):
        av_x = np.sqrt(running_sum(sub * sub) / f32(SUB))
    weights = av_x + np.abs(sub)
    scales, mins, quants = make_qkx2_quants(sub, weights, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = positive_max(scales)
    max_min = positive_max(mins)
    with np.errstate(all="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))[:, None]
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))[:, None]
        ls = np.minimum(63, low_byte(nearest_int(inv_scale * scales)))
        lm = np.minimum(63, low_byte(nearest_int(inv_min * mins)))
        d, dmin = fp16(max_scale / f32(63)), fp16(max_min / f32(63))
    packed, quants = requantized(sub, quants, d, dmin, ls, lm, nmax)
    return d, dmin, packed, quants


def requantized(
    sub: np.ndarray, quants: np.ndarray, d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray, nmax: int
) -> tuple[np.ndarray, np.ndarray]:
    """The last Q4_K / Q5_K steps: the sub-block scales ``ls`` and minimums ``lm`` (n, 8) packed
    into 12 bytes, read back (``get_scale_min_k4``) and each value quantized again against them
    (a sub-block of scale 0 keeps the search's ``quants`` (32, n * 8)): the packed (n, 12) and
    the quants (n, 256), 0..nmax."""
    n = d.shape[0]
    packed = np.empty((n, 12), np.int32)
    packed[:, 0:4] = (ls[:, :4] | ((ls[:, 4:] >> 4) << 6)) & 0xFF
    packed[:, 4:8] = (lm[:, :4] | ((lm[:, 4:] >> 4) << 6)) & 0xFF
    packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    sc = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 0x0F) | ((packed[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    with np.errstate(all="ignore"):
        sub_d = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).reshape(-1)
        sub_m = (dmin.astype(np.float32)[:, None] * m.astype(np.float32)).reshape(-1)
        again = np.clip(nearest_int((sub + sub_m) / sub_d), 0, nmax)
    return packed, np.where(sub_d != 0, again, quants).T.reshape(n, 256)


def positive_max(v: np.ndarray) -> np.ndarray:
    """Per row: ``m = 0; if (v > m) m = v`` over the row."""
    top = np.fmax.reduce(v, axis=1)
    out: np.ndarray = np.where(top > 0, top, f32(0))
    return out
