"""A gpt-oss GGUF whose experts are GGML's ``MXFP4`` (as llama.cpp writes OpenAI's release,
:mod:`.mxfp4`) read back as that release: the experts' blocks and e8m0 scales as stored,
repacked into the release's order (:func:`~.mxfp4.release_blocks`), never dequantized.

The opened GGUF shows the release's tensors (``mlp.experts.gate_up_proj_blocks`` with the gate
and up rows interleaved again, ``down_proj_blocks``, each with its ``_scales``; the others as
:mod:`.hf_view` makes them) and the release's ``quantization_config``, so it is a quantized
source like the release itself (:mod:`ckptkit.quant.mxfp4`): kept as stored where the target
holds MXFP4, dequantized by the reference recipe (``--dtype``) elsewhere.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf.experts import expert_gguf_name
from ckptkit.formats.gguf.made import Made, Reader
from ckptkit.formats.gguf.mxfp4 import release_blocks
from ckptkit.quant.mxfp4 import BLOCK, BLOCKS, SCALES

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.gguf.reader import GGUFHeader

MXFP4 = "MXFP4"
# OpenAI's gpt-oss releases' quantization_config (the GGUF keeps no record of it)
RELEASE_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj" + BLOCKS  # a name the family takes as the release's layout


def holds_release(h: GGUFHeader) -> bool:
    """Whether ``h``'s experts are GGML MXFP4 (llama.cpp's GGUF of an MXFP4 release)."""
    return any(t.kind == MXFP4 and _EXPERTS.fullmatch(t.name) for t in h.tensors)


def experts(reader: Reader, tmap: Any, name: str, shape: tuple[int, ...]) -> tuple[Made, Made]:
    """The release's ``X_blocks`` (``name``, uint8 ``shape`` [E, rows, n, 16]) and ``X_scales``
    [E, rows, n] of gpt-oss's MXFP4 ``ffn_down_exps`` (``down_proj``) or ``ffn_gate_exps`` and
    ``ffn_up_exps`` (``gate_up_proj``: their rows interleaved, gate first)."""
    prefix, proj = name.removesuffix(BLOCKS).rsplit(".", 1)
    parts = [proj] if proj == "down_proj" else ["gate_proj", "up_proj"]
    names = [expert_gguf_name(tmap, f"{prefix}.{p}.weight") for p in parts]
    where = reader.raw.root / reader.raw.config_name
    for part in names:
        info = reader.info(part)
        kind = _kind(reader, part)
        want = (shape[0], shape[1] // len(parts), shape[2] * BLOCK)
        if kind != MXFP4 or tuple(info.shape) != want or shape[1] % len(parts):
            raise CkptkitError(
                f"{where}: {part} is {kind} {list(info.shape)}; the release's {name} {list(shape)} needs it "
                f"MXFP4 {list(want)} (its experts are MXFP4 in every layer, or in none)"
            )
    made: dict[str, torch.Tensor] = {}  # the scales, unpacked with their blocks

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        got = [release_blocks(_stored(reader, p)) for p in names]
        if len(got) == 1:
            return got[0]
        blocks, scales = (torch.stack(parts, dim=2).flatten(1, 2) for parts in zip(*got, strict=True))
        return blocks, scales

    def blocks() -> torch.Tensor:
        out, made["scales"] = both()
        return out

    def scales() -> torch.Tensor:
        return made.pop("scales") if "scales" in made else both()[1]

    return Made(shape, "uint8", blocks), Made(shape[:-1], "uint8", scales)


def scales_name(blocks: str) -> str:
    return blocks.removesuffix(BLOCKS) + SCALES


def _kind(reader: Reader, name: str) -> str:
    return _tensors(reader).stored[name].kind


def _stored(reader: Reader, name: str) -> torch.Tensor:
    return _tensors(reader).stored_bytes(name)


def _tensors(reader: Reader) -> Any:
    """The GGUF's own reader (:class:`~ckptkit.formats.gguf.GGUFTensors`): its types and stored bytes."""
    tensors = reader.raw.readers[reader.raw.config_name]
    assert hasattr(tensors, "stored_bytes")
    return tensors
