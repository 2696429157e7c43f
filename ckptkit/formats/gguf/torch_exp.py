"""``-exp(x)`` of bfloat16 values as llama.cpp's converter computes Qwen3.5's and Qwen3-Next's
``ssm_a`` from ``A_log``, without torch: torch's float32 ``exp`` of the values widened to
float32 (x86-64 builds: MKL's vector exp, whatever ATen's CPU capability), which is the
correctly rounded exp but at 45 of the 65,536 inputs (:mod:`.torch_exp_table`, made by
``fixtures/make_torch_exp_table.py``; every input checked against torch by the tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def rounded_exp(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """The correctly rounded float32 exp of bfloat16 values (``bits``): float64's exp, whose
    error is far below the distance of these inputs' exps from a float32 rounding boundary,
    rounded to float32."""
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
