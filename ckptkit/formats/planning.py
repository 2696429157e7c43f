"""The plan a folder format writes by default: restore the recorded layout, or lay out afresh.

:meth:`ckptkit.formats.format.CheckpointFormat.plan` is this module's :func:`folder_plan`
unless a format lays its output out otherwise (GGUF); the format's :class:`FolderPlanner`
answers the questions it asks (its targets, its default files, its metadata and tokenizer
files) and says which writer writes each weight file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ckptkit.errors import CkptkitError, NoMetaLayout, note
from ckptkit.formats.base import FilePlan, OpenedCheckpoint, Options, Plan
from ckptkit.formats.containers import tensor_file_writer
from ckptkit.formats.writers import TensorWriter
from ckptkit.models.moe import MoEFields
from ckptkit.models.moe import experts as experts_of
from ckptkit.quant import recorded_scales, with_scales
from ckptkit.tensors.casting import checked_cast
from ckptkit.tensors.dtypes import FLOATING, to_torch
from ckptkit.tensors.lazy import Lazy, decoded_lazy
from ckptkit.tokenization import TokenizerPlan

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.transforms import Transform


class PlannedFormat(Protocol):
    """What a planner asks of its format (a ``CheckpointFormat``): its name and layout."""

    name: ClassVar[str]

    def layout(self, family: Family, cfg: ModelConfig) -> Layout: ...


class FolderPlanner:
    """How a folder format lays a checkpoint out: the questions :func:`folder_plan` asks,
    answered by default for a format whose files hold the family's :meth:`layout`; a format
    subclasses it for its file names (:meth:`default_files`, which every folder format
    answers) and its metadata, tokenizer and extra tensors."""

    def __init__(self, fmt: PlannedFormat) -> None:
        self.fmt = fmt

    def plan(self, ckpt: OpenedCheckpoint, opts: Options) -> Plan:
        """The plan of ``ckpt`` in this format (:func:`folder_plan`)."""
        return folder_plan(self, ckpt, opts)

    def extra_tensors(self, family: Family, cfg: ModelConfig) -> dict[str, Lazy]:
        """Tensors this format's own checkpoints carry that the model does not use."""
        return {}

    def targets(
        self, ckpt: OpenedCheckpoint, pool: dict[str, Lazy], with_optional: bool
    ) -> tuple[dict[str, Lazy], list[str]]:
        """(native name -> tensor to write, notes) from the canonical tensors and ``pool``,
        the unused tensors this conversion could carry."""
        from ckptkit.formats.canonical import native_targets

        layout = self.write_layout(ckpt)
        targets = native_targets(ckpt.tensors, layout, ckpt.config, with_optional)
        for name, lazy in self.extra_tensors(ckpt.family, ckpt.config).items():
            pool.setdefault(name, lazy)
        targets.update({k: v for k, v in pool.items() if layout.is_unused(k)})
        dropped = [k for k in pool if not layout.is_unused(k)]
        notes = []
        if dropped:
            why = f"{self.fmt.name} does not hold them, the model does not use them"
            notes.append(note(f"not carried ({why}): {', '.join(dropped[:4])}"))
        return targets, notes

    def write_layout(self, ckpt: OpenedCheckpoint) -> Layout:
        """The layout written: the format's layout of the family."""
        try:
            return self.fmt.layout(ckpt.family, ckpt.config)
        except NoMetaLayout as e:  # "qwen2 has no Meta layout": which checkpoint (the plan adds where it can go)
            uses = "" if self.fmt.name == "meta" else f" (which {self.fmt.name} writes)"
            raise NoMetaLayout(f"{ckpt.path}: {e}{uses}") from None
        except CkptkitError as e:
            raise CkptkitError(f"{ckpt.path}: {e}") from None

    def rules(self, ckpt: OpenedCheckpoint) -> list[tuple[str, tuple[str, ...], Transform]]:
        """(native name, canonical names, transform) of each tensor this format writes."""
        return [(r.native, r.canonical, r.kind) for r in self.write_layout(ckpt).expand(ckpt.config.num_layers)]

    def required(self, ckpt: OpenedCheckpoint) -> set[str]:
        """Native names a restored layout must place."""
        layout = self.write_layout(ckpt)
        return {r.native for r in layout.expand(ckpt.config.num_layers) if not r.optional}

    def split_dim(self, name: str, ndim: int, family: Family) -> int | None:
        """The dim model-parallel ranks split tensor ``name`` on (None: replicated)."""
        return None

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        """File names and partition for a fresh layout: (files, rank split dims)."""
        raise NotImplementedError

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        """Non-weight files to write (config, index): name -> text."""
        return {}

    def keeps_hf_files(self, origin: dict[str, Any]) -> bool:
        """Whether this format's checkpoints (converted from ``origin``) hold an HF folder's
        non-weight files as they were."""
        return False

    def tokenizer(self, ckpt: OpenedCheckpoint) -> TokenizerPlan:
        """What to do with the source's tokenizer files: by default carry them as they are."""
        return TokenizerPlan()

    def writer(self, path: Path, plan: Plan, file: FilePlan, direct: bool) -> TensorWriter:
        """The writer of one output weight file of ``plan``: by default the container its
        name says (:func:`ckptkit.formats.containers.tensor_file_writer`)."""
        return tensor_file_writer(path, plan.entries(file), file.metadata, file.aliases, direct, file.archive)


def folder_plan(planner: FolderPlanner, ckpt: OpenedCheckpoint, opts: Options) -> Plan:
    """Decide file names, partition, order and metadata of the output."""
    origin = ckpt.origin
    restore = origin.get("format") == planner.fmt.name and opts.shards is None and opts.max_shard_size is None
    ckpt, restore = experts_view(ckpt, opts.experts, restore)
    targets, notes = planner.targets(ckpt, _unused_pool(ckpt), with_optional=restore)
    companions: dict[str, tuple[str, ...]] = {}  # weight -> its scales, placed after it
    if ckpt.quant is not None:  # kept quantized: each weight's scale beside it
        natives: dict[str, tuple[str, Any]] = {}
        for native, canonical, kind in planner.rules(ckpt):
            natives.setdefault(canonical[0], (native, kind))
            if (
                canonical[0] in ckpt.quant.scales
                and native in targets
                and not (kind.is_identity() or kind.permutes_rows)
            ):
                raise CkptkitError(  # a source's quantized weights are kept only where each is stored as itself
                    f"--dtype fp8: --to {planner.fmt.name} stores {native} as several weights in one tensor (fused "
                    "or stacked), and ckptkit writes block FP8 only where each weight is stored as itself; pass "
                    "--experts per-expert for stacked experts, or convert without --dtype fp8"
                )
        targets, companions = with_scales(targets, ckpt.quant, natives, ckpt.config)
    if opts.dtype is not None:
        kept = [k for k, v in targets.items() if v.dtype not in FLOATING]
        if kept:
            notes.append(note(f"not cast (not floating point, kept as stored): {', '.join(kept[:4])}"))
    targets = {k: _cast(k, v, opts.dtype, opts.allow_lossy_cast) for k, v in targets.items()}
    plan = _restored_plan(ckpt, planner, targets, notes, companions) if restore else None
    if plan is None:
        files, split = planner.default_files(ckpt, targets, opts)
        plan = Plan(planner.fmt.name, targets, files, split, notes=notes)
    plan.quant_config = ckpt.quant.config if ckpt.quant is not None else None
    plan.tokenizer = planner.tokenizer(ckpt)
    plan.notes.extend(plan.tokenizer.notes)
    plan.metadata_files.update(planner.metadata_files(ckpt, plan, opts.dtype))
    plan.verify_cast = opts.dtype
    plan.writes = planner.writer
    return plan


def with_experts(ckpt: OpenedCheckpoint, layout: str) -> OpenedCheckpoint:
    if ckpt.config.fields(MoEFields).experts_layout == layout:
        return ckpt
    config = ckpt.config.replace_fields(experts_layout=layout)
    return dataclasses.replace(ckpt, config=config)  # type: ignore[type-var]  # a Checkpoint: a dataclass


def experts_view(ckpt: OpenedCheckpoint, experts: str | None, restore: bool) -> tuple[OpenedCheckpoint, bool]:
    """``ckpt`` seen with the experts layout the output takes, and whether the recorded
    layout is still restored: ``experts`` when given (a recorded layout in the other
    experts layout is not restored), else on a restore the recorded layout's, else the
    source's (its tensor names, or the config an internal checkpoint recorded). Orientation
    and names come from the layout's rules and the config, never from tensor shapes."""
    moe = experts_of(ckpt.config)
    if moe is None:
        return ckpt, restore
    recorded = moe.experts_layout
    if restore:
        names = [k for f in ckpt.origin.get("files") or [] for k in f["keys"]]
        recorded = ckpt.family.refine_config(ckpt.config, names).fields(MoEFields).experts_layout
    want = experts or recorded
    return with_experts(ckpt, want), restore and want == recorded


def _cast(name: str, lazy: Lazy, dtype: str | None, allow_lossy: bool) -> Lazy:
    if dtype is None or lazy.dtype not in FLOATING or lazy.dtype == dtype:
        return lazy
    return Lazy(
        lazy.shape, dtype, lambda: checked_cast(lazy.get(), to_torch(dtype), name, lazy.file, allow_lossy), lazy.file
    )


def _plain_copies(ckpt: OpenedCheckpoint, planner: FolderPlanner) -> dict[str, str]:
    """Native name -> the canonical tensor it is an unchanged copy of (copied or tied)."""
    from ckptkit.tensors.transforms import COPY, TIED

    rules = planner.write_layout(ckpt).expand(ckpt.config.num_layers)
    return {r.native: r.canonical[0] for r in rules if r.kind in (COPY, TIED) and len(r.canonical) == 1}


def _shared_storage(
    ckpt: OpenedCheckpoint, planner: FolderPlanner, recorded: dict[str, str], keys: list[str]
) -> dict[str, str]:
    """The recorded aliases (key -> key whose storage it shares) that still hold: both
    written, both the same canonical tensor unchanged."""
    if not recorded:
        return {}
    copies = _plain_copies(ckpt, planner)
    return {a: p for a, p in recorded.items() if a in keys and p in keys and copies.get(a, a) == copies.get(p, p)}


def _unused_pool(ckpt: OpenedCheckpoint) -> dict[str, Lazy]:
    """Tensors the model does not use that this conversion could carry, by native name."""
    pool: dict[str, Lazy] = {}
    for name, enc in (ckpt.origin.get("unused") or {}).items():
        pool[name] = decoded_lazy(enc)
    pool.update(ckpt.unused)
    return pool


def _restored_plan(
    ckpt: OpenedCheckpoint,
    planner: FolderPlanner,
    targets: dict[str, Lazy],
    notes: list[str],
    companions: dict[str, tuple[str, ...]],
) -> Plan | None:
    """The recorded layout of ``planner`` (file names, order, ranks, storage sharing), if it
    still fits; ``companions``: tensors placed right after another one where the record
    does not place them (a quantized weight's scale)."""
    origin = ckpt.origin
    placed = [k for f in origin["files"] for k in f["keys"]]
    required = planner.required(ckpt)
    missing = [k for k in targets if k not in placed and k in required]
    if missing:
        notes.append(
            note(
                f"the recorded {planner.fmt.name} layout does not fit this model ({missing[0]}): "
                "written in the default layout"
            )
        )
        return None
    scales = recorded_scales((origin.get("config") or {}).get("text"), placed)  # of weights now dequantized
    absent = sorted({k for k in placed if k not in targets} - scales)
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
        keys = []
        for k in f["keys"]:
            if k in targets:
                keys.append(k)
                keys.extend(extra for extra in companions.get(k, ()) if extra not in placed)
        aliases = _shared_storage(ckpt, planner, f.get("aliases") or {}, keys)
        files.append(
            FilePlan(f["name"], keys, f.get("metadata"), rank=i, ranks=n, aliases=aliases, archive=f.get("archive"))
        )
    keep = {k for f in files for k in f.keys}
    split = dict(origin.get("split_dims") or {})
    if n > 1:
        for k in keep:
            split.setdefault(k, planner.split_dim(k, len(targets[k].shape), ckpt.family))
    return Plan(
        planner.fmt.name,
        {k: v for k, v in targets.items() if k in keep},
        files,
        split if n > 1 else {},
        restored=True,
        notes=notes,
    )
