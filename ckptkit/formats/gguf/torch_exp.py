"""``-exp(x)`` of bfloat16 values as llama.cpp's converter computes Qwen3.5's and Qwen3-Next's
``ssm_a`` from ``A_log``, without torch: torch's float32 ``exp`` of the values widened to
float32, which is the correctly rounded exp but at 45 of the 65,536 inputs
(:mod:`.torch_exp_table`, made by ``fixtures/make_torch_exp_table.py``; every input checked
against the installed torch by the tests). Measured with torch 2.13.0+cpu on x86-64: the same
under ATen's AVX2 and default CPU capabilities and MKL's SSE4.2 code path, not glibc's
``expf`` (MKL's vector exp, by all signs); another build may differ, which the test reports."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

TORCH_EXP_MEASURED = platform.machine().lower() in ("x86_64", "amd64")
"""Whether torch here is a build whose exp the table was measured on (x86-64, MKL's vector
exp): elsewhere (aarch64's torch, without MKL) ``A_log`` goes through torch itself, as
llama.cpp's converter on that machine computes it."""

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def rounded_exp(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """The correctly rounded float32 exp of bfloat16 values (``bits``): float64's exp rounded
    to float32 (at every finite input the correctly rounded value: checked with mpmath)."""
    import numpy as np

    wide = (bits.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(wide.astype(np.float64)).astype(np.float32)


def neg_exp_bf16(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """``-torch.exp(x.float())`` of the bfloat16 values ``bits``, bit for bit (NaNs included)."""
    import numpy as np

    from ckptkit.formats.gguf.torch_exp_table import EXCEPTIONS

    out = rounded_exp(bits).view(np.uint32)
    keys = np.fromiter(EXCEPTIONS, np.uint16, len(EXCEPTIONS))
    hit = np.isin(bits, keys)
    if hit.any():
        out[hit] = np.vectorize(EXCEPTIONS.__getitem__, otypes=[np.uint32])(bits[hit])
    out ^= np.uint32(0x80000000)  # negation flips the sign bit, a NaN's too
    return out.view(np.float32)
