"""The F32 tensors llama.cpp widened from a bf16 or f16 model, read back in that dtype.

llama.cpp's converter writes 1-D tensors, norms and MoE routers as F32 whatever the file
type (:func:`~ckptkit.formats.gguf.tensors.qtype`): a bf16 model's norms come out F32, with
the same values. Where ``general.file_type`` says bf16 or f16 (or ``MOSTLY_MXFP4_MOE``, a
gpt-oss release whose other weights are all BF16 or all F16) and such a tensor's values
(bits included) are all exact in that dtype, it is read back in it, as the HF model held
it; otherwise it stays float32. The decision reads the tensor's values once, when the file
is opened; 1-D tensors (small) are kept from that read, so their bytes are read once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptkit.formats.gguf.reader import GGUFHeader, GGUFTensorInfo, meta_int
from ckptkit.formats.gguf.tensors import qtype

if TYPE_CHECKING:
    import torch

GENERATED = ("rope_freqs.weight",)  # computed by llama.cpp, not the model's: never narrowed


def file_dtype(h: GGUFHeader) -> str | None:
    """The dtype ``general.file_type`` says the model was written in: bfloat16, float16 or None."""
    ftype = _model_ftype(h)
    return None if ftype is None else {"MOSTLY_BF16": "bfloat16", "MOSTLY_F16": "float16"}[ftype.name]


def _model_ftype(h: GGUFHeader) -> Any:
    """``general.file_type`` when bf16 or f16; for ``MOSTLY_MXFP4_MOE`` (llama.cpp's file type
    of an MXFP4 source at f32, f16 or bf16) the one its other weights were written in."""
    import gguf

    t = gguf.LlamaFileType
    found = meta_int(h, "general.file_type")
    if found == t.MOSTLY_MXFP4_MOE:
        kinds = {x.kind for x in h.tensors if len(x.shape) >= 2 and x.kind not in ("MXFP4", "F32")}
        return {frozenset({"BF16"}): t.MOSTLY_BF16, frozenset({"F16"}): t.MOSTLY_F16}.get(frozenset(kinds))
    return t(found) if found in (t.MOSTLY_BF16, t.MOSTLY_F16) else None


def widened(h: GGUFHeader) -> list[GGUFTensorInfo]:
    """The F32 tensors llama.cpp's converter writes as F32 in a file of ``h``'s file type
    (bf16 or f16; none for another)."""
    import gguf

    ftype = _model_ftype(h)
    if ftype is None:
        return []
    f32 = gguf.GGMLQuantizationType.F32
    return [
        t for t in h.tensors if t.kind == "F32" and t.name not in GENERATED and qtype(t.name, t.shape, ftype) == f32
    ]


def narrowed(t: torch.Tensor, dtype: str) -> torch.Tensor | None:
    """Float32 ``t`` as ``dtype`` (bfloat16 or float16) when every value, bits included, is
    exact there (widening the result gives ``t`` back bit for bit), else None."""
    import torch

    bits = t.view(torch.int32)
    if dtype == "bfloat16":  # the high halves, when the low halves are all 0 (NaN payloads kept)
        if bool((bits & 0xFFFF).any()):
            return None
        return (bits >> 16).to(torch.int16).view(torch.bfloat16)
    out = t.to(torch.float16)
    return out if torch.equal(out.to(torch.float32).view(torch.int32), bits) else None
