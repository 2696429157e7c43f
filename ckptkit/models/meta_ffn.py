"""Meta's FFN size rule and its inverse.

Meta's reference model derives the FFN width from ``dim``: two thirds of ``4 * dim``,
times ``ffn_dim_multiplier`` when given, rounded up to a multiple of ``multiple_of``.
Writing a Meta ``params.json`` for an HF model means finding a pair that gives its
``intermediate_size`` back; the search runs over every divisor of that size.
"""

from __future__ import annotations

import math

from ckptkit.errors import CkptkitError

MAX_MULTIPLIER_DECIMALS = 9


def meta_ffn_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's FFN size: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
    h = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _preference(n: int, m: int) -> tuple[bool, int, int]:
    """Candidate order for ``multiple_of``: not the size itself, most factors of two, smallest."""
    return (m == n, -((m & -m).bit_length()), m)


def _multiplier(base: int, low: int, high: int, decimals: int) -> float | None:
    """The smallest multiplier with ``decimals`` decimals for which ``int(x * base)`` lies in [low, high]."""
    scale = 10**decimals
    first = max(1, math.floor(low * scale / base) - 1)
    last = math.ceil((high + 1) * scale / base) + 1
    for k in range(first, min(last, first + 4) + 1):
        x = round(k / scale, decimals)
        if low <= int(x * base) <= high:
            return x
    return None


def meta_ffn_params(dim: int, ffn: int) -> tuple[int, float | None]:
    """A (multiple_of, ffn_dim_multiplier) pair that reproduces ``ffn`` for ``dim``.

    Prefers no multiplier, then multipliers with the fewest decimals; within each,
    ``multiple_of`` values with the most factors of two.
    """
    base = int(2 * 4 * dim / 3)
    if ffn < 1 or base < 1:
        raise CkptkitError(f"intermediate size {ffn} cannot be expressed as Meta's FFN rule for dim {dim}")
    candidates = sorted(_divisors(ffn), key=lambda m: _preference(ffn, m))
    for m in candidates:
        if meta_ffn_size(dim, m, None) == ffn:
            return m, None
    for decimals in range(1, MAX_MULTIPLIER_DECIMALS + 1):
        for m in candidates:
            x = _multiplier(base, ffn - m + 1, ffn, decimals)
            if x is not None and meta_ffn_size(dim, m, x) == ffn:
                return m, x
    raise CkptkitError(
        f"intermediate size {ffn} cannot be expressed as Meta's multiple_of/ffn_dim_multiplier for dim {dim}"
    )
