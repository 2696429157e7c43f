"""QLoRA: the frozen linears of the decoder layers kept as torchao NF4 tensors.

As QLoRA defines it (and torchtune's ``quantize_base``): every linear weight of the
decoder layers, LoRA-targeted or not, becomes 4-bit NormalFloat in blocks of 64 values
with their absmax scales quantized again to 8 bits in blocks of 256 (double
quantization). Embeddings, norms and the output projection stay as they are. The
forward dequantizes to the input's dtype (torchao's ``linear_nf4``, reached through
``F.linear``), so adapters train in their own bf16/fp32 on top of the 4-bit base.

Merging (``lora.merge_base``): ``nf4`` (default) adds the adapter to the dequantized NF4
base it was trained against; ``original`` to the 16-bit weights of the input checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptkit.errors import CkptkitError

BLOCK_SIZE = 64
"""Values per NF4 block (one absmax scale each), QLoRA's choice."""
SCALER_BLOCK_SIZE = 256
"""Scales per block of the double quantization (one float32 factor each), QLoRA's choice."""


def _torchao() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor  # torchao >= 0.18
    except ImportError:
        raise CkptkitError("quantize_base=nf4 needs torchao: pip install 'ckptkit[qlora]'") from None
    return nf4_tensor


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a torchao NF4 tensor (block 64, double-quantized scales, block 256)."""
    return _torchao().to_nf4(weight.detach(), BLOCK_SIZE, SCALER_BLOCK_SIZE)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torchao NF4 tensor (False when torchao is not installed)."""
    return type(tensor).__name__ == "NF4Tensor"


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an NF4 tensor dequantized to its original dtype, any other as it is."""
    if not is_nf4(tensor):
        return tensor
    return tensor.get_original_weight().to(tensor.dtype)  # type: ignore[attr-defined]


def shard(tensor: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rows ``index`` of ``parts`` of an NF4 tensor (as FSDP2 splits dim 0), in storage of its
    own. Quantized whole, each part keeps the full tensor's blocks and scales (torchao's clone
    would quantize the part again, and ``distribute_tensor`` splits the scales wrongly)."""
    part = torch.chunk(tensor, parts, dim=0)[index]
    inner = {name: getattr(part, name).clone() for name in part.__tensor_flatten__()[0]}  # type: ignore[attr-defined]
    nf4_tensor = _torchao()
    return nf4_tensor.NF4Tensor(*nf4_tensor.construct_nf4_args(part, inner))


def check_shardable(model: nn.Module, parts: int) -> None:
    """Refuse, before FSDP2 shards ``model`` over ``parts`` ranks, an NF4 weight whose shards
    would not hold whole blocks of scales (each needs a multiple of 64 x 256 values), and a
    world of one (torch's FSDP2 then skips the all-gather that rebuilds NF4 weights)."""
    if parts == 1:
        raise CkptkitError("quantize_base under FSDP2 needs 2 or more processes; run lora_finetune on one device")
    per_rank = BLOCK_SIZE * SCALER_BLOCK_SIZE * parts
    for name, param in model.named_parameters():
        if local_is_nf4(param) and (param.shape[0] % parts or param.numel() % per_rank):
            raise CkptkitError(
                f"{name} {tuple(param.shape)} does not split into {parts} NF4 shards of whole blocks "
                f"(a multiple of {per_rank} values); run on fewer processes or lora_finetune on one device"
            )


def local_is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, or this rank's shard of it (an FSDP2 DTensor), is an NF4 tensor."""
    return is_nf4(getattr(tensor, "_local_tensor", tensor))


def quantized_linears(model: nn.Module) -> list[str]:
    """Names of the linears whose weights NF4 replaces: every linear inside a decoder layer."""
    return [n for n, m in model.named_modules() if n.startswith("layers.") and isinstance(m, nn.Linear)]


@torch.no_grad()
def quantize_base(model: nn.Module) -> list[str]:
    """Replace the (frozen) weight of every decoder-layer linear by its NF4 tensor, on the
    weight's own device (on the meta device: the NF4 layout FSDP2 shards, filled when the
    weights are loaded); returns the weights' state-dict keys. Weights already NF4 (sharded
    by FSDP2) stay as they are."""
    keys = []
    for name in quantized_linears(model):
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        if local_is_nf4(module.weight):
            keys.append(f"{name}.weight")
            continue
        if module.weight.requires_grad:
            raise CkptkitError(f"{name}.weight trains; only frozen base weights can be kept in NF4")
        if module.weight.dim() != 2 or module.weight.numel() % (BLOCK_SIZE * SCALER_BLOCK_SIZE):
            raise CkptkitError(
                f"{name}.weight {tuple(module.weight.shape)} is not a multiple of "
                f"{BLOCK_SIZE * SCALER_BLOCK_SIZE} values; NF4 cannot quantize it"
            )
        module.weight = nn.Parameter(to_nf4(module.weight), requires_grad=False)
        keys.append(f"{name}.weight")
    return keys


def merge_base_weight(mode: str, nf4: torch.Tensor, original: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The base a merge starts from: the dequantized NF4 weight (``nf4``) or the input's
    16-bit weight (``original``, read by ``original()`` in the NF4 tensor's dtype)."""
    if mode == "nf4":
        return dequantize(nf4)
    if mode == "original":
        return original().to(nf4.dtype)
    raise CkptkitError(f"merge_base must be nf4 or original, not {mode!r}")
