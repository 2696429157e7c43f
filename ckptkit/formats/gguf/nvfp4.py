"""modelopt NVFP4 weights in GGUF as llama.cpp's converter writes them: kept in GGML's
``NVFP4`` type, repacked, never re-quantized, written before every other tensor in the order
it reads the source, each followed by its ``weight_scale_2`` as ``<name>.scale`` and its
``input_scale`` as ``<name>.input_scale`` (F32 ``[1]``; either left out where it is 1 within
1e-6); ``k_scale`` / ``v_scale`` are not written.

GGML's NVFP4 block is 64 values in 36 bytes: the e4m3 scales of its four 16-value
sub-blocks with the sign bit cleared (UE4M3), then each sub-block's 16 codes in 8 bytes in
GGML's nibble order (:func:`~ckptkit.formats.gguf.mxfp4.ggml_nibbles`). ``weight_scale_2`` is
not folded in: llama.cpp multiplies by it at inference, and ckptkit when it reads the GGUF
back. Q/K rows and their block scales' rows are permuted as llama.cpp's Llama permutes them.
``general.file_type`` is ``MOSTLY_NVFP4`` where the other tensors are F32, F16 or BF16.

Experts (``....experts.E.{gate,up,down}_proj.weight``, llama.cpp's test) are merged per layer
and projection into one NVFP4 tensor [E, rows, cols] (``blk.N.ffn_*_exps.weight``), written
when the config's ``num_local_experts`` (or ``num_experts``)-th expert of it has been read
(all of them after the other NVFP4 weights where the config has neither), followed by their
``weight_scale_2`` and ``input_scale`` as F32 [E] vectors in expert order (each left out where
every value is 1 within numpy's ``allclose``; a missing one counts as 1), never folded in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, note
from ckptkit.formats.gguf.gguf_tensor import GGUFTensor
from ckptkit.formats.gguf.mxfp4 import ggml_nibbles, release_pairs
from ckptkit.quant.mxfp4 import e2m1_values
from ckptkit.quant.nvfp4 import BLOCK

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import OpenedCheckpoint
    from ckptkit.formats.gguf.reader import GGUFHeader
    from ckptkit.models.gguf_spec import GGUFSpec
    from ckptkit.tensors.lazy import Lazy

SUPER = 64  # values per GGML NVFP4 block: four e4m3 sub-blocks
SCALE, INPUT_SCALE = ".scale", ".input_scale"  # the GGUF names' suffixes of weight_scale_2 and input_scale
Rows = Callable[[str], "Callable[[torch.Tensor], torch.Tensor] | None"]  # HF name -> its Q/K row permutation
EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")  # llama.cpp's test for one
LAYER = re.compile(r"\.layers\.(\d+)\.")


def is_nvfp4(ckpt: OpenedCheckpoint) -> bool:
    """Whether ``ckpt`` holds NVFP4 weights as stored (not dequantized by the plan)."""
    return ckpt.quant is not None and ckpt.quant.method.ggml_type == "NVFP4"


def ggml_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GGML's NVFP4 bytes of modelopt's uint8 ``packed`` [rows, cols / 2] with e4m3 ``scale``
    [rows, cols / 16]: uint8 [rows, cols / 64 * 36]."""
    import torch

    rows, n = scale.shape
    codes = ggml_nibbles(packed.reshape(rows, n, BLOCK // 2)).reshape(rows, n // 4, 4 * BLOCK // 2)
    scales = (scale.contiguous().view(torch.uint8) & 0x7F).reshape(rows, n // 4, 4)
    return torch.cat((scales, codes), dim=-1).reshape(rows, -1)


def ggml_values(blocks: torch.Tensor, factor: float | None = None) -> torch.Tensor:
    """float32 (n, 64) of GGML NVFP4 blocks uint8 (n, 36): each code's e2m1 value times its
    sub-block's UE4M3 scale, exact in float32. The gguf package's ``dequantize`` values (its
    scale decoding: bit 7 ignored, the bytes 0 and 0x7F read as 0), with the sign of zero
    kept: the code -0 gives -0.0, as in the source, where the package gives +0.0. With
    ``factor`` (the weight's ``.scale``), modelopt's dequantization instead: each value times
    its sub-block's float32 ``UE4M3 x factor`` (two roundings, in modelopt's order)."""
    import torch

    x = torch.arange(256)
    exponent, mantissa = (x >> 3) & 0xF, (x & 7).float()
    lut = torch.where(exponent == 0, mantissa * 2**-9, (1 + mantissa / 8) * torch.exp2(exponent.float() - 7))
    lut = torch.where((x == 0) | (x == 0x7F), 0.0, lut)
    n = blocks.shape[0]
    scales = lut[blocks[:, :4].long()]
    if factor is not None:
        scales = scales * torch.tensor(factor, dtype=torch.float32)
    values = e2m1_values(release_pairs(blocks[:, 4:].reshape(n, 4, BLOCK // 2)))
    return (values * scales.unsqueeze(-1)).reshape(n, SUPER)


def check_layout(ckpt: OpenedCheckpoint, spec: GGUFSpec) -> None:
    """Refuse in one line the families whose converter reorders NVFP4 weights its own way."""
    if spec.linear_attention or spec.latent_attention:
        raise CkptkitError(
            f"{ckpt.path}: ckptkit writes NVFP4 weights to GGUF for models with standard attention "
            f"(not {ckpt.family.name}); convert it --to hf --dtype bfloat16 first, or with llama.cpp's converter"
        )


def tensors(
    ckpt: OpenedCheckpoint,
    order: list[str],
    targets: dict[str, Lazy],
    tmap: Any,
    rows: Rows,
    hparams: dict[str, Any],
) -> list[GGUFTensor]:
    """The NVFP4 weights among the HF names ``order``, as llama.cpp writes them ahead of the
    others: each weight (element shape), then its non-trivial ``.scale`` and ``.input_scale``;
    experts merged (:func:`_merged`)."""
    import gguf

    out: list[GGUFTensor] = []
    scales = _hf_scales(ckpt, targets)
    n = next((hparams[k] for k in ("num_local_experts", "num_experts") if k in hparams), 0) or 0  # its find_hparam
    pending: dict[tuple[int, str], list[tuple[int, str]]] = {}  # (layer, projection) -> (expert, HF name)
    for hf_name in order:
        if hf_name not in scales:
            continue
        _check_rows(ckpt, hf_name, targets[hf_name])
        if found := EXPERT.search(hf_name):
            layer = LAYER.search(hf_name)
            key = (int(layer.group(1)) if layer else 0, found.group(2))
            pending.setdefault(key, []).append((int(found.group(1)), hf_name))
            if n and len(pending[key]) >= n:
                out += _merged(ckpt, key, pending.pop(key), targets, scales, tmap)
            continue
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise CkptkitError(f"{ckpt.path}: llama.cpp has no GGUF name for NVFP4 weight {hf_name!r}")
        lazy, (block, global_scale) = targets[hf_name], scales[hf_name]
        shape = (lazy.shape[0], lazy.shape[1] * 2)
        out.append(GGUFTensor(new, shape, gguf.GGMLQuantizationType.NVFP4, _maker(lazy, block, rows(hf_name))))
        out += _scale(new.replace(".weight", SCALE), global_scale.get())
        found_input = _input_scale(ckpt, hf_name.removesuffix("weight") + "input_scale")
        if found_input is not None:
            out += _scale(new.replace(".weight", INPUT_SCALE), found_input)
    for key, experts in pending.items():  # llama.cpp's flush of those it could not count
        out += _merged(ckpt, key, experts, targets, scales, tmap)
    kept = [t.name for t in out if t.name.endswith(INPUT_SCALE)]
    if kept:
        fact = f"{len(kept)} input_scale(s) written as llama.cpp writes them ({kept[0]}, ...); k_scale / v_scale not"
        ckpt.notes.append(note(fact))
    return out


def _check_rows(ckpt: OpenedCheckpoint, hf_name: str, lazy: Lazy) -> None:
    if lazy.shape[-1] * 2 % SUPER:
        raise CkptkitError(
            f"{ckpt.path}: NVFP4 weight {hf_name} has rows of {lazy.shape[-1] * 2} values; GGML's NVFP4 type "
            f"holds rows of whole {SUPER}-value blocks (llama.cpp's converter fails on it too)"
        )


def _merged(
    ckpt: OpenedCheckpoint,
    key: tuple[int, str],
    experts: list[tuple[int, str]],
    targets: dict[str, Lazy],
    scales: dict[str, tuple[Lazy, ...]],
    tmap: Any,
) -> list[GGUFTensor]:
    """llama.cpp's ``_flush_nvfp4_experts``: the experts of one layer's projection, in expert
    order, as one NVFP4 tensor [E, rows, cols] made one expert at a time, then the experts'
    ``weight_scale_2`` and ``input_scale`` as F32 [E] vectors (none where all are 1)."""
    import gguf

    from ckptkit.formats.gguf.experts import stack
    from ckptkit.tensors.lazy import Lazy

    layer, projection = key
    new = tmap.get_name(f"model.layers.{layer}.mlp.experts.{projection}.weight", try_suffixes=(".weight",))
    if new is None:
        raise CkptkitError(f"{ckpt.path}: llama.cpp has no GGUF name for the merged NVFP4 experts {projection}")
    names = [name for _, name in sorted(experts)]
    shapes = {targets[name].shape for name in names}
    if len(shapes) > 1:
        raise CkptkitError(f"{ckpt.path}: the NVFP4 experts {projection} of layer {layer} differ in shape")
    rows, packed = targets[names[0]].shape
    parts = [Lazy((rows, packed // 4 * 9), "uint8", _maker(targets[n], scales[n][0], None)) for n in names]
    shape = (len(names), rows, packed * 2)
    out = [GGUFTensor(new, shape, gguf.GGMLQuantizationType.NVFP4, lambda: stack(parts))]
    global_scales = [float(scales[n][1].get().float().sum()) for n in names]
    inputs = [_input_scale(ckpt, n.removesuffix("weight") + "input_scale") for n in names]
    out += _vector(new.replace(".weight", SCALE), global_scales)
    out += _vector(new.replace(".weight", INPUT_SCALE), [1.0 if i is None else float(i.float().sum()) for i in inputs])
    return out


def _vector(name: str, values: list[float]) -> list[GGUFTensor]:
    """llama.cpp's ``_write_scales_tensor``: F32 [E], none where numpy's ``allclose(values,
    1.0, atol=1e-6)`` holds (each within 1e-6 + 1e-5 of 1)."""
    import gguf
    import torch

    if all(abs(v - 1.0) <= 1e-6 + 1e-5 for v in values):
        return []
    flat = torch.tensor(values, dtype=torch.float32)
    return [GGUFTensor(name, (len(values),), gguf.GGMLQuantizationType.F32, lambda: flat)]


def _scale(name: str, t: torch.Tensor) -> list[GGUFTensor]:
    """llama.cpp's ``_write_scale_tensor``: the float32 values, none where one value is 1 within 1e-6."""
    import gguf
    import torch

    flat = t.to(torch.float32).reshape(-1)
    if flat.numel() <= 1 and abs(float(flat.sum()) - 1.0) < 1e-6:
        return []
    return [GGUFTensor(name, tuple(flat.shape), gguf.GGMLQuantizationType.F32, lambda: flat)]


def _hf_scales(ckpt: OpenedCheckpoint, targets: dict[str, Lazy]) -> dict[str, tuple[Lazy, ...]]:
    """HF weight name -> its (``weight_scale``, ``weight_scale_2``), rows in HF's order."""
    from ckptkit.formats.registry import transformers_format
    from ckptkit.quant import with_scales

    assert ckpt.quant is not None
    hf = transformers_format()
    natives: dict[str, tuple[str, Any]] = {}
    for native, canonical, kind in hf.planner(hf).rules(ckpt):
        natives.setdefault(canonical[0], (native, kind))
    placed, companions = with_scales(targets, ckpt.quant, natives, ckpt.config)
    return {w: tuple(placed[s] for s in names) for w, names in companions.items()}


def _input_scale(ckpt: OpenedCheckpoint, name: str) -> torch.Tensor | None:
    """The activation scale ``name`` as the HF folder llama.cpp reads stores it (a source of
    another format has none: ckptkit drops them when it writes that folder)."""
    from ckptkit.formats.registry import find_format

    raw = ckpt.raw
    fmt = find_format(raw.format)
    if fmt is None or not fmt.info.loads_in_transformers:
        return None
    file = next((f for f, keys in raw.files.items() if name in keys), None)
    return None if file is None else raw.readers[file].read(name)


def _maker(
    packed: Lazy, scale: Lazy, permute: Callable[[torch.Tensor], torch.Tensor] | None
) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        w, s = packed.get(), scale.get()
        if permute is not None:
            w, s = permute(w), permute(s)
        return ggml_rows(w, s)

    return make


def read_companions(header: GGUFHeader) -> tuple[dict[str, str], list[str]]:
    """(NVFP4 weight -> its ``.scale`` tensor, the ``.input_scale`` tensors) of a GGUF as
    llama.cpp writes them; one line for either that is not F32 with one value (per expert
    of a merged [E, rows, cols] weight)."""
    stored = {t.name: t for t in header.tensors}
    scales: dict[str, str] = {}
    inputs: list[str] = []
    for t in header.tensors:
        if t.kind != "NVFP4" or not t.name.endswith(".weight"):
            continue
        values = t.shape[0] if len(t.shape) == 3 else 1
        for suffix in (SCALE, INPUT_SCALE):
            name = t.name.removesuffix(".weight") + suffix
            found = stored.get(name)
            if found is None:
                continue
            if found.kind != "F32" or math.prod(found.shape) != values or len(found.shape) != 1:
                what = "one F32 value" if values == 1 else f"F32 [{values}], one value per expert"
                raise CkptkitError(
                    f"{header.path}: tensor {name!r} is {found.kind} {list(found.shape)}; llama.cpp writes "
                    f"an NVFP4 weight's {suffix[1:]} as {what}"
                )
            if suffix == SCALE:
                scales[t.name] = name
            else:
                inputs.append(name)
    return scales, inputs


def factors(scale: torch.Tensor, name: str, where: object) -> list[float]:
    """The values of NVFP4 weight ``name``'s ``.scale`` (one per expert of a merged weight),
    each a finite float32 (one line otherwise)."""
    import torch

    flat = scale.reshape(-1)
    bad = ~torch.isfinite(flat)
    if bool(bad.any()):
        raise CkptkitError(f"{where}: the scale of NVFP4 weight {name!r} is {float(flat[bad][0])}, not a finite number")
    return [float(v) for v in flat]
