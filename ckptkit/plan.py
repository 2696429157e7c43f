"""Deciding what a conversion writes: the target format's plan, after the choices it
cannot make alone are checked (``--experts`` against every registered format).

The target format (a registry object) lays the output out in one call,
:meth:`~ckptkit.formats.format.CheckpointFormat.plan`; folder formats share
:func:`ckptkit.formats.planning.folder_plan` (restore the recorded layout, or lay out afresh).
"""

from __future__ import annotations

import dataclasses

from ckptkit.checkpoint import Checkpoint
from ckptkit.errors import CkptkitError, FlagError, NoMetaLayout, note
from ckptkit.formats import REGISTRY, CheckpointFormat, find_format, format_names
from ckptkit.formats.base import FilePlan, Options, Plan, shared_json
from ckptkit.formats.planning import with_experts
from ckptkit.formats.registry import formats_writing
from ckptkit.models import EXPERTS_LAYOUTS
from ckptkit.models.moe import experts as experts_of
from ckptkit.quant import DEFAULT_DEQUANTIZED, FP8_DTYPE, dequantized, keeps_in, quantized
from ckptkit.quant.fp8 import BlockFP8
from ckptkit.tensors.dtypes import FLOATING

__all__ = [
    "FilePlan", "Options", "Plan", "check_experts_choice", "dequantized_checkpoint", "plan_conversion",
    "target_format",
]  # fmt: skip


def target_format(name: str) -> CheckpointFormat:
    fmt = find_format(name)
    if fmt is None:
        raise CkptkitError(f"unknown target format {name!r}; choose one of {', '.join(format_names())}")
    return fmt


def plan_conversion(ckpt: Checkpoint, opts: Options) -> Plan:
    """Decide file names, partition, order and metadata of the output. Each JSON file the plan
    reads through :func:`~ckptkit.formats.base.read_json_shared` (the GGUF vocabulary's
    tokenizer.json) is parsed once, and nothing parsed is kept once the plan is made."""
    fmt = target_format(opts.to)
    check_experts_choice(ckpt, fmt, opts.experts)
    ckpt, opts = quantization_for(ckpt, fmt, opts)
    with shared_json():
        try:
            return fmt.plan(ckpt, opts)
        except NoMetaLayout as e:
            raise CkptkitError(f"{e}; convert it to {formats_writing(ckpt.family)}") from None


# --dtype fp8 from an unquantized source: DeepSeek's and Qwen's release config
FP8_RELEASE_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def quantization_for(ckpt: Checkpoint, fmt: CheckpointFormat, opts: Options) -> tuple[Checkpoint, Options]:
    """``ckpt`` as ``fmt`` writes it: quantized weights kept as stored (with their scales)
    where the format holds them and no ``--dtype`` says otherwise, else dequantized to
    ``--dtype`` (bfloat16 by default); ``--dtype fp8`` keeps or makes block FP8."""
    quant = ckpt.quant
    if opts.dtype == FP8_DTYPE:
        opts = dataclasses.replace(opts, dtype=None)
        if quant is None:
            tensors, made = quantized(ckpt.tensors, BlockFP8(FP8_RELEASE_CONFIG, ckpt.path))
            return dataclasses.replace(ckpt, tensors=tensors, quant=made), opts
    if quant is None:
        return ckpt, opts
    try:
        rules = fmt.planner(fmt).rules(ckpt) if fmt.info.holds_quantized else []
    except CkptkitError:
        rules = []  # the format does not hold this family: its own plan says so
    if opts.dtype is None and rules and keeps_in(quant, rules, ckpt.config.head_dim, ckpt.tensors):
        return ckpt, opts
    if fmt.info.takes_pre_tokenizer and quant.method.ggml_type is not None:  # GGUF: kept as llama.cpp keeps them
        return ckpt, opts
    dtype = opts.dtype or DEFAULT_DEQUANTIZED
    if dtype not in FLOATING:  # a GGML type (q8_0, Q4_K_M): quantized from the float32 product, as llama.cpp does
        dtype = "float32"
    if opts.dtype is None:
        ckpt.notes.append(
            note(
                f"{len(quant.scales)} {quant.method.name} weights dequantized to {dtype} "
                f"(--to {fmt.name} does not hold them as stored)",
                "to choose the dtype, pass --dtype",
            )
        )
    return dequantized_checkpoint(ckpt, dtype), opts


def dequantized_checkpoint(ckpt: Checkpoint, dtype: str) -> Checkpoint:
    """``ckpt`` with its quantized weights dequantized to ``dtype`` as they are read, under
    the names and in the layout the model holds them (no quantization left); as it is when
    not quantized."""
    if ckpt.quant is None:
        return ckpt
    tensors = dequantized(ckpt.tensors, ckpt.quant, dtype)
    config = ckpt.family.refine_config(ckpt.config, tensors)  # gpt-oss: no MXFP4 blocks left
    return dataclasses.replace(ckpt, tensors=tensors, config=config, quant=None)


def check_experts_choice(ckpt: Checkpoint, fmt: CheckpointFormat, experts: str | None) -> None:
    """Refuse ``--experts`` where it means nothing: a model without experts, or a target
    format that stores experts one way only."""
    if experts is None:
        return
    if experts not in EXPERTS_LAYOUTS:
        raise CkptkitError(f"--experts must be one of {', '.join(EXPERTS_LAYOUTS)}, not {experts!r}")
    if experts_of(ckpt.config) is None:
        raise CkptkitError(
            f"--experts applies to mixture-of-experts models; {ckpt.path} ({ckpt.family.name}) has no experts"
        )
    if _offers_experts_choice(ckpt, fmt) is False:
        takers = [name for name, f in REGISTRY.items() if _offers_experts_choice(ckpt, f)]
        raise FlagError(
            f"--to {fmt.name} stores {ckpt.family.name} experts one way only; "
            f"--experts applies to --to {' or '.join(takers) or '(no format)'}"
        )


def _offers_experts_choice(ckpt: Checkpoint, fmt: CheckpointFormat) -> bool | None:
    """Whether ``fmt`` names ``ckpt``'s tensors differently in the two experts layouts
    (None: it does not hold this family at all, which the conversion itself reports)."""
    if fmt.info.file_suffix is not None:
        return False if fmt.support(ckpt.family).writes else None
    try:
        planner = fmt.planner(fmt)
        names = [set(planner.targets(with_experts(ckpt, x), {}, True)[0]) for x in EXPERTS_LAYOUTS]
    except CkptkitError:
        return None
    return any(n != names[0] for n in names[1:])
