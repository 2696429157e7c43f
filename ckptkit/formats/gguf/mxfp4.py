"""gpt-oss's MXFP4 experts in GGUF as llama.cpp's converter writes them: kept in GGML's
``MXFP4`` type, their bytes repacked, never re-quantized; the other tensors as the file type says.

GGML's MXFP4 block is 17 bytes for 32 values: the e8m0 scale, then 16 bytes whose low
nibbles are values 0..15 and high nibbles values 16..31. OpenAI's release stores the same
32 e2m1 codes as 16 bytes of pairs (value 2j in the low nibble of byte j, 2j+1 in the high
one) with the scales in a tensor of their own (:mod:`ckptkit.quant.mxfp4`). llama.cpp writes
these tensors before any other, in the order it reads their scales (the source's order), as
``ffn_down_exps`` [E, rows, cols] and the interleaved ``gate_up_proj`` rows split into
``ffn_gate_exps`` (even rows) and ``ffn_up_exps`` (odd rows); ``general.file_type`` is
``MOSTLY_MXFP4_MOE`` where the other tensors are F32, F16 or BF16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf.experts import expert_gguf_name
from ckptkit.quant.mxfp4 import BLOCK, BLOCKS

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import OpenedCheckpoint
    from ckptkit.tensors.lazy import Lazy

Made = tuple[str, tuple[int, ...], Callable[[], "torch.Tensor"]]  # GGUF name, element shape, packed bytes


def is_mxfp4(ckpt: OpenedCheckpoint) -> bool:
    """Whether ``ckpt`` holds MXFP4 weights as stored (not dequantized by the plan)."""
    return ckpt.quant is not None and ckpt.quant.method.name == "mxfp4"


def ggml_nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """GGML's nibble order of a block of e2m1 codes stored as releases store them: uint8
    [..., k] of pairs (code 2j in the low nibble of byte j, 2j + 1 in the high one) ->
    uint8 [..., k] with codes 0..k-1 in the low nibbles and k..2k-1 in the high ones
    (MXFP4's 32-code blocks, NVFP4's 16-code sub-blocks alike)."""
    import torch

    codes = torch.stack((pairs & 0x0F, pairs >> 4), dim=-1).flatten(-2)  # [..., 2k] in value order
    k = pairs.shape[-1]
    return codes[..., :k] | (codes[..., k:] << 4)


def release_pairs(nibbles: torch.Tensor) -> torch.Tensor:
    """:func:`ggml_nibbles` undone."""
    import torch

    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # [..., 2k] in value order
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GGML's MXFP4 bytes of release ``blocks`` uint8 [..., n, 16] with e8m0 ``scales``
    [..., n]: uint8 [..., n * 17], each block its scale then its 16 repacked bytes."""
    import torch

    return torch.cat((scales.unsqueeze(-1), ggml_nibbles(blocks)), dim=-1).flatten(-2)


def release_blocks(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ggml_blocks` undone: (blocks [..., n, 16], scales [..., n]) of GGML bytes [..., n * 17]."""
    per = data.unflatten(-1, (-1, 1 + BLOCK // 2))
    return release_pairs(per[..., 1:]), per[..., 0].contiguous()


def expert_tensors(ckpt: OpenedCheckpoint, order: list[str], targets: dict[str, Lazy], tmap: Any) -> list[Made]:
    """The MXFP4 expert tensors of the HF names ``order`` (those ending ``_blocks``), as
    llama.cpp writes them ahead of the others: name, element shape, GGML bytes."""
    assert ckpt.quant is not None
    out: list[Made] = []
    for hf_name in order:
        if not hf_name.endswith(BLOCKS):
            continue
        canonical = hf_name.removeprefix("model.")
        found = ckpt.quant.scales.get(canonical)  # MXFP4: one scale per weight
        scale = found[0] if found else None
        proj = hf_name.removesuffix(BLOCKS).rsplit(".", 1)[-1]
        if scale is None or proj not in ("gate_up_proj", "down_proj"):
            raise CkptkitError(f"{ckpt.path}: llama.cpp writes no MXFP4 tensor {hf_name!r} to GGUF")
        lazy = targets[hf_name]
        e, rows, n = lazy.shape[0], lazy.shape[1], lazy.shape[2]
        if proj == "down_proj":
            parts = [("down_proj", 0, 1)]
        else:
            parts, rows = [("gate_proj", 0, 2), ("up_proj", 1, 2)], rows // 2
        for name, start, step in parts:
            new = expert_gguf_name(tmap, hf_name.removesuffix(proj + BLOCKS) + name + ".weight")
            out.append((new, (e, rows, n * BLOCK), _maker(lazy, scale, start, step)))
    return out


def _maker(blocks: Lazy, scales: Lazy, start: int, step: int) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        return ggml_blocks(blocks.get()[:, start::step], scales.get()[:, start::step])

    return make
