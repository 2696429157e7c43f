"""Deciding what a conversion writes: tensors, file names, partition, order and metadata.

The target format (a registry object) supplies everything format-specific; this module
only decides between restoring a recorded layout and laying out afresh, and casts.
"""

from __future__ import annotations

import dataclasses

from ckptkit.checkpoint import Checkpoint
from ckptkit.errors import CkptkitError, FlagError, note
from ckptkit.formats import REGISTRY, CheckpointFormat, find_format, format_names
from ckptkit.formats.base import FilePlan, Options, Plan
from ckptkit.models import EXPERTS_LAYOUTS
from ckptkit.tensors.casting import checked_cast
from ckptkit.tensors.dtypes import FLOATING, to_torch
from ckptkit.tensors.lazy import Lazy, decoded_lazy

__all__ = ["FilePlan", "Options", "Plan", "check_experts_choice", "plan_conversion", "target_format"]


def target_format(name: str) -> CheckpointFormat:
    fmt = find_format(name)
    if fmt is None:
        raise CkptkitError(f"unknown target format {name!r}; choose one of {', '.join(format_names())}")
    return fmt


def plan_conversion(ckpt: Checkpoint, opts: Options) -> Plan:
    """Decide file names, partition, order and metadata of the output."""
    fmt = target_format(opts.to)
    origin = ckpt.origin
    restore = origin.get("format") == fmt.name and opts.shards is None and opts.max_shard_size is None
    ckpt, restore = _experts_view(ckpt, fmt, opts.experts, restore)
    targets, notes = fmt.targets(ckpt, _unused_pool(ckpt), with_optional=restore)
    if opts.dtype is not None:
        kept = [k for k, v in targets.items() if v.dtype not in FLOATING]
        if kept:
            notes.append(note(f"not cast (not floating point, kept as stored): {', '.join(kept[:4])}"))
    targets = {k: _cast(k, v, opts.dtype, opts.allow_lossy_cast) for k, v in targets.items()}
    plan = _restored_plan(ckpt, fmt, targets, notes) if restore else None
    if plan is None:
        files, split = fmt.default_files(ckpt, targets, opts)
        plan = Plan(fmt.name, targets, files, split, notes=notes)
    plan.tokenizer = fmt.tokenizer(ckpt)
    plan.notes.extend(plan.tokenizer.notes)
    plan.metadata_files.update(fmt.metadata_files(ckpt, plan, opts.dtype))
    return plan


def check_experts_choice(ckpt: Checkpoint, fmt: CheckpointFormat, experts: str | None) -> None:
    """Refuse ``--experts`` where it means nothing: a model without experts, or a target
    format that stores experts one way only."""
    if experts is None:
        return
    if experts not in EXPERTS_LAYOUTS:
        raise CkptkitError(f"--experts must be one of {', '.join(EXPERTS_LAYOUTS)}, not {experts!r}")
    if not ckpt.config.num_experts:
        raise CkptkitError(
            f"--experts applies to mixture-of-experts models; {ckpt.path} ({ckpt.family.name}) has no experts"
        )
    if _offers_experts_choice(ckpt, fmt) is False:
        takers = [name for name, f in REGISTRY.items() if _offers_experts_choice(ckpt, f)]
        raise FlagError(
            f"--to {fmt.name} stores {ckpt.family.name} experts one way only; "
            f"--experts applies to --to {' or '.join(takers) or '(no format)'}"
        )


def _with_experts(ckpt: Checkpoint, layout: str) -> Checkpoint:
    if ckpt.config.experts_layout == layout:
        return ckpt
    return dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, experts_layout=layout))


def _offers_experts_choice(ckpt: Checkpoint, fmt: CheckpointFormat) -> bool | None:
    """Whether ``fmt`` names ``ckpt``'s tensors differently in the two experts layouts
    (None: it does not hold this family at all, which the conversion itself reports)."""
    if fmt.writes_file:
        return False if fmt.supports(ckpt.family)[1] else None
    try:
        names = [set(fmt.targets(_with_experts(ckpt, x), {}, True)[0]) for x in EXPERTS_LAYOUTS]
    except CkptkitError:
        return None
    return any(n != names[0] for n in names[1:])


def _experts_view(
    ckpt: Checkpoint, fmt: CheckpointFormat, experts: str | None, restore: bool
) -> tuple[Checkpoint, bool]:
    """``ckpt`` seen with the experts layout the output takes, and whether the recorded
    layout is still restored: ``experts`` when given (a recorded layout in the other
    experts layout is not restored), else on a restore the recorded layout's, else the
    source's (its tensor names, or the config an internal checkpoint recorded). Orientation
    and names come from the layout's rules and the config, never from tensor shapes."""
    check_experts_choice(ckpt, fmt, experts)
    if not ckpt.config.num_experts:
        return ckpt, restore
    recorded = ckpt.config.experts_layout
    if restore:
        names = [k for f in ckpt.origin.get("files") or [] for k in f["keys"]]
        recorded = ckpt.family.refine_config(ckpt.config, names).experts_layout
    want = experts or recorded
    return _with_experts(ckpt, want), restore and want == recorded


def _cast(name: str, lazy: Lazy, dtype: str | None, allow_lossy: bool) -> Lazy:
    if dtype is None or lazy.dtype not in FLOATING or lazy.dtype == dtype:
        return lazy
    return Lazy(
        lazy.shape, dtype, lambda: checked_cast(lazy.get(), to_torch(dtype), name, lazy.file, allow_lossy), lazy.file
    )


def _plain_copies(ckpt: Checkpoint, fmt: CheckpointFormat) -> dict[str, str]:
    """Native name -> the canonical tensor it is an unchanged copy of (copied or tied)."""
    from ckptkit.tensors.transforms import COPY, TIED

    rules = fmt.write_layout(ckpt).expand(ckpt.config.num_layers)
    return {r.native: r.canonical[0] for r in rules if r.kind in (COPY, TIED) and len(r.canonical) == 1}


def _shared_storage(
    ckpt: Checkpoint, fmt: CheckpointFormat, recorded: dict[str, str], keys: list[str]
) -> dict[str, str]:
    """The recorded aliases (key -> key whose storage it shares) that still hold: both
    written, both the same canonical tensor unchanged."""
    if not recorded:
        return {}
    copies = _plain_copies(ckpt, fmt)
    return {a: p for a, p in recorded.items() if a in keys and p in keys and copies.get(a, a) == copies.get(p, p)}


def _unused_pool(ckpt: Checkpoint) -> dict[str, Lazy]:
    """Tensors the model does not use that this conversion could carry, by native name."""
    pool: dict[str, Lazy] = {}
    for name, enc in (ckpt.origin.get("unused") or {}).items():
        pool[name] = decoded_lazy(enc)
    pool.update(ckpt.unused)
    return pool


def _restored_plan(ckpt: Checkpoint, fmt: CheckpointFormat, targets: dict[str, Lazy], notes: list[str]) -> Plan | None:
    """The recorded layout of ``fmt`` (file names, order, ranks, storage sharing), if it still fits."""
    origin = ckpt.origin
    placed = [k for f in origin["files"] for k in f["keys"]]
    required = fmt.required(ckpt)
    missing = [k for k in targets if k not in placed and k in required]
    if missing:
        notes.append(
            note(
                f"the recorded {fmt.name} layout does not fit this model ({missing[0]}): written in the default layout"
            )
        )
        return None
    absent = sorted({k for k in placed if k not in targets})
    if absent:
        notes.append(
            note(
                f"not restored (no longer available): {', '.join(absent[:4])}",
                "to keep them, convert from the checkpoint that had them",
            )
        )
    n = len(origin["files"])
    files = []
    for i, f in enumerate(origin["files"]):
        keys = [k for k in f["keys"] if k in targets]
        aliases = _shared_storage(ckpt, fmt, f.get("aliases") or {}, keys)
        files.append(
            FilePlan(f["name"], keys, f.get("metadata"), rank=i, ranks=n, aliases=aliases, archive=f.get("archive"))
        )
    keep = {k for f in files for k in f.keys}
    split = dict(origin.get("split_dims") or {})
    if n > 1:
        for k in keep:
            split.setdefault(k, fmt.split_dim(k, len(targets[k].shape), ckpt.family))
    return Plan(
        fmt.name,
        {k: v for k, v in targets.items() if k in keep},
        files,
        split if n > 1 else {},
        restored=True,
        notes=notes,
    )
