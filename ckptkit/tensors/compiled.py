"""The options every numba-compiled loop of ckptkit is built with (``kernel``).

Without ``fastmath`` LLVM neither reorders sums nor contracts multiply-adds into FMA, so a
float32 operation is rounded as the scalar C or torch reference rounds it. Functions are
cached on disk (``cache=True``: compiled once per machine, checked against the file of the
function only) and run without the GIL, so a thread pool spreads them over the cores."""

from __future__ import annotations

import numba

kernel = numba.njit(nogil=True, cache=True, error_model="numpy")
"""The decorator of every compiled loop."""
