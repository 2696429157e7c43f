"""What Q2_K, Q4_K and Q5_K share: ggml's ``make_qkx2_quants`` search for each sub-block's
scale and minimum, and the super-block step of ``quantize_row_q{4,5}_K_ref`` (6-bit scales
and minimums under two float16 super-scales, then the quants again)."""

from __future__ import annotations

import numpy as np

from ckptkit.formats.gguf.encoders.common import ZERO, f32, first_extreme, fp16, low_byte, nearest_int, running_sum

SUB = 32


CHUNK = 8192  # columns searched at a time: the trial arrays (32 x CHUNK float32) stay in cache
EXACT = f32(2.0**22)  # below this magnitude ggml's nearest_int is round-half-even, as np.rint


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)`` for
    every column of ``x`` and weights ``w`` (n, m): the scales and minimums (m,) and the
    quants ``L`` (n, m).

    Columns are independent, so they are searched ``CHUNK`` at a time (each chunk's arrays
    stay in cache); a chunk with a NaN or an infinity takes :func:`_make_qkx2_quants_int`."""
    m = x.shape[1]
    scales, mins = np.empty(m, np.float32), np.empty(m, np.float32)
    quants = np.empty(x.shape, np.int32)
    for i in range(0, m, CHUNK):
        cols = slice(i, i + CHUNK)
        xc, wc = x[:, cols], w[:, cols]
        search = _make_qkx2_quants_rint if np.isfinite(xc).all() else _make_qkx2_quants_int
        scales[cols], mins[cols], quants[:, cols] = search(xc, wc, nmax, rmin, rdelta, nstep, use_mad)
    return scales, mins, quants


def _start(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """The first loop of ``make_qkx2_quants``: per column ``min`` and ``max`` of ``x`` (the
    minimum before ``if (min > 0) min = 0``), ``sum_w`` and ``sum_x``."""
    lo = first_extreme(x.T, largest=False)
    hi = first_extreme(x.T, largest=True)
    sum_w = w[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, x.shape[0]):
        sum_w += w[i]
        sum_x += w[i] * x[i]
    return lo, hi, sum_w, sum_x


def _make_qkx2_quants_rint(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`make_qkx2_quants` of finite ``x``, the trial levels a float32 ``rint`` of
    ``iscale * (x - min)`` clipped in one scratch array: every column where that can reach
    ``2**22`` in magnitude (bounded from its ``min`` and ``max``: float32 rounding is
    monotonic) is made again with ggml's ``nearest_int``. ``-0.0`` levels change no sum."""
    xmin, hi, sum_w, sum_x = _start(x, w)
    lo = np.where(xmin > 0, f32(0), xmin)
    flat, flat_min = hi == lo, -lo
    s, t, wl = (np.empty(x.shape, np.float32) for _ in range(3))
    top = f32(nmax)

    def levels(iscale: np.ndarray, lo: np.ndarray) -> np.ndarray:
        np.subtract(x, lo, out=s)
        np.multiply(s, iscale, out=s)
        np.rint(s, out=s)
        np.clip(s, ZERO, top, out=s)
        bound = np.maximum(np.abs(iscale * (xmin - lo)), np.abs(iscale * (hi - lo)))
        far = np.flatnonzero(~(bound < EXACT) & ~flat)  # NaN included; flat columns are dropped
        if far.size:
            s[:, far] = np.clip(nearest_int(iscale[far] * (x[:, far] - lo[far])), 0, nmax)
        return s

    def error(scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
        np.multiply(scale, s, out=t)
        np.add(t, mn, out=t)
        np.subtract(t, x, out=t)
        if use_mad:
            np.abs(t, out=t)
        else:
            np.multiply(t, t, out=t)
        np.multiply(t, w, out=t)
        return running_sum(t)

    with np.errstate(all="ignore"):
        iscale = top / (hi - lo)
        scale = f32(1) / iscale
        best_iscale, best_lo = iscale, lo
        levels(iscale, lo)
        best = error(scale, lo)
        for step in range(nstep + 1):
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + top) / (hi - lo)
            levels(iscale, lo)
            np.multiply(w, s, out=wl)
            sum_l = running_sum(wl)
            np.multiply(wl, s, out=t)
            sum_l2 = running_sum(t)
            np.multiply(wl, x, out=t)
            sum_xl = running_sum(t)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clipped = this_min > 0
            this_min = np.where(clipped, f32(0), this_min)
            this_scale = np.where(clipped, sum_xl / sum_l2, this_scale)
            cur = error(this_scale, this_min)
            better = (det > 0) & (cur < best)
            best_iscale = np.where(better, iscale, best_iscale)
            best_lo = np.where(better, lo, best_lo)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
        quants = levels(best_iscale, best_lo).astype(np.int32)
    return np.where(flat, f32(0), scale), np.where(flat, flat_min, -lo), np.where(flat, 0, quants)


def _make_qkx2_quants_int(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`make_qkx2_quants` with ggml's integer ``nearest_int`` (any values, NaN included)."""
    lo, hi, sum_w, sum_x = _start(x, w)
    lo = np.where(lo > 0, f32(0), lo)
    flat, flat_min = hi == lo, -lo

    def error(diff: np.ndarray) -> np.ndarray:
        return running_sum(w * (np.abs(diff) if use_mad else diff * diff))

    def levels(iscale: np.ndarray, lo: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip(nearest_int(iscale * (x - lo)), 0, nmax)
        return out

    # each column's quants are those of its best trial's (iscale, lo), made again at the end
    with np.errstate(all="ignore"):
        iscale = f32(nmax) / (hi - lo)
        scale = f32(1) / iscale
        best_iscale, best_lo = iscale, lo
        best = error(scale * levels(iscale, lo).astype(np.float32) + lo - x)
        for step in range(nstep + 1):
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (hi - lo)
            lf = levels(iscale, lo).astype(np.float32)
            wl = w * lf
            sum_l, sum_l2, sum_xl = running_sum(wl), running_sum(wl * lf), running_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clipped = this_min > 0
            this_min = np.where(clipped, f32(0), this_min)
            this_scale = np.where(clipped, sum_xl / sum_l2, this_scale)
            cur = error(this_scale * lf + this_min - x)
            better = (det > 0) & (cur < best)
            best_iscale = np.where(better, iscale, best_iscale)
            best_lo = np.where(better, lo, best_lo)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
        quants = levels(best_iscale, best_lo)
    return np.where(flat, f32(0), scale), np.where(flat, flat_min, -lo), np.where(flat, 0, quants)


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
