"""The streaming converter: source checkpoint -> target format, one tensor at a time.

For each target tensor it fetches the canonical tensors it needs from the source,
applies the target format's transform, casts if asked, and writes it into every file
that holds it (one file for HF shards, every rank for Meta). Output goes to a temporary
directory beside the destination, renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import split_state_dict_into_shards_factory

from ckptkit.checkpoint import FORMATS, Checkpoint, Lazy, decode_tensor, open_checkpoint
from ckptkit.dtypes import CAST_TARGETS, FLOATING, dtype_name, to_torch
from ckptkit.errors import CkptkitError
from ckptkit.formats import hf, internal, meta
from ckptkit.formats.base import INTERNAL_FILE, ORIGIN_FILE
from ckptkit.formats.safetensors_io import SafetensorsWriter, library_order
from ckptkit.formats.torch_io import TorchPickleWriter
from ckptkit.models.spec import COPY, FUSED, ROPE_K, ROPE_Q, TIED, Layout
from ckptkit.progress import byte_progress
from ckptkit.transforms import join_rows, rope_hf_to_meta, split_ranks

DEFAULT_MAX_SHARD = "5GB"


@dataclass
class FilePlan:
    """One output weight file: its tensors in stored order and, for Meta ranks, the split."""

    name: str
    keys: list[str]
    metadata: dict[str, str] | None = None
    rank: int = 0
    ranks: int = 1


@dataclass
class Plan:
    format: str
    targets: dict[str, Lazy]  # native name -> full tensor to write
    files: list[FilePlan]
    split_dims: dict[str, int | None] = field(default_factory=dict)
    metadata_files: dict[str, str] = field(default_factory=dict)  # name -> text
    restored: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Options:
    to: str
    dtype: str | None = None
    shards: int | None = None
    max_shard_size: str | None = None


# --- what to write -------------------------------------------------------------------


def _cast(lazy: Lazy, dtype: str | None) -> Lazy:
    if dtype is None or lazy.dtype not in FLOATING or lazy.dtype == dtype:
        return lazy
    return Lazy(lazy.shape, dtype, lambda: lazy.get().to(to_torch(dtype)), lazy.file)


def _native_targets(ckpt: Checkpoint, layout: Layout, with_optional: bool) -> dict[str, Lazy]:
    cfg, canon = ckpt.config, ckpt.tensors
    out: dict[str, Lazy] = {}
    for rule in layout.expand(cfg.num_layers):
        if rule.optional and not with_optional:
            continue
        parts = [canon[c] for c in rule.canonical]
        first = parts[0]
        if rule.kind in (COPY, TIED):
            out[rule.native] = first
        elif rule.kind in (ROPE_Q, ROPE_K):
            heads = cfg.num_heads if rule.kind == ROPE_Q else cfg.num_kv_heads
            out[rule.native] = Lazy(first.shape, first.dtype, lambda g=first.get, h=heads: rope_hf_to_meta(g(), h))
        elif rule.kind == FUSED:
            shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
            out[rule.native] = Lazy(shape, first.dtype, lambda ps=parts: join_rows([p.get() for p in ps]))
    return out


def _unused_pool(ckpt: Checkpoint) -> dict[str, Lazy]:
    """Tensors the model does not use that this conversion could carry, by native name."""
    pool: dict[str, Lazy] = {}
    for name, enc in (ckpt.origin.get("unused") or {}).items():
        pool[name] = Lazy(tuple(enc["shape"]), enc["dtype"], lambda e=enc: decode_tensor(e))
    pool.update(ckpt.unused)
    return pool


def _layout_for(ckpt: Checkpoint, fmt: str) -> Layout:
    if fmt == "meta":
        try:
            return ckpt.family.meta_layout(ckpt.config)
        except CkptkitError as e:  # "qwen2 has no Meta layout": say which checkpoint
            raise CkptkitError(f"{ckpt.path}: {e}") from None
    return ckpt.family.hf_layout(ckpt.config)


def plan_conversion(ckpt: Checkpoint, opts: Options) -> Plan:
    """Decide file names, partition, order and metadata of the output."""
    fmt = opts.to
    if fmt not in FORMATS:
        raise CkptkitError(f"unknown target format {fmt!r}; choose one of {', '.join(FORMATS)}")
    cast = opts.dtype
    origin = ckpt.origin
    restore = origin.get("format") == fmt and opts.shards is None and opts.max_shard_size is None
    pool = _unused_pool(ckpt)
    notes: list[str] = []
    if fmt == "internal":
        targets = dict(ckpt.tensors)
        targets.update({internal.UNUSED_PREFIX + k: v for k, v in ckpt.unused.items()})
        layout = None
    else:
        layout = _layout_for(ckpt, fmt)
        targets = _native_targets(ckpt, layout, with_optional=restore)
        if fmt == "meta":
            for name, t in ckpt.family.meta_extra_tensors(ckpt.config).items():
                pool.setdefault(name, Lazy(tuple(t.shape), dtype_name(t.dtype), lambda t=t: t))
        dropped = [k for k in pool if not layout.is_unused(k)]
        targets.update({k: v for k, v in pool.items() if layout.is_unused(k)})
        if dropped:
            notes.append(
                f"not carried ({fmt} does not hold them, the model does not use them): {', '.join(dropped[:4])}"
            )
    targets = {k: _cast(v, cast) for k, v in targets.items()}

    plan = None
    if restore:
        plan = _restored_plan(ckpt, fmt, targets, notes)
    if plan is None:
        plan = _default_plan(ckpt, fmt, targets, opts, notes)
    plan.metadata_files.update(_metadata_files(ckpt, plan, cast))
    return plan


def _restored_plan(ckpt: Checkpoint, fmt: str, targets: dict[str, Lazy], notes: list[str]) -> Plan | None:
    origin = ckpt.origin
    placed = [k for f in origin["files"] for k in f["keys"]]
    missing = [k for k in targets if k not in placed and k in _required(ckpt, fmt)]
    if missing:
        notes.append(f"the recorded {fmt} layout does not fit this model ({missing[0]}); using the default layout")
        return None
    absent = sorted({k for k in placed if k not in targets})
    if absent:
        notes.append(f"not restored (no longer available): {', '.join(absent[:4])}")
    n = len(origin["files"])
    files = [
        FilePlan(f["name"], [k for k in f["keys"] if k in targets], f.get("metadata"), rank=i, ranks=n)
        for i, f in enumerate(origin["files"])
    ]
    keep = {k for f in files for k in f.keys}
    split = {k: v for k, v in (origin.get("split_dims") or {}).items()}
    if fmt == "meta" and n > 1:
        for k in keep:
            split.setdefault(k, meta.split_dim(k, len(targets[k].shape), ckpt.family.vocab_parallel))
    return Plan(
        fmt, {k: v for k, v in targets.items() if k in keep}, files, split if n > 1 else {}, restored=True, notes=notes
    )


def _required(ckpt: Checkpoint, fmt: str) -> set[str]:
    if fmt == "internal":
        return set(ckpt.tensors)
    layout = _layout_for(ckpt, fmt)
    return {r.native for r in layout.expand(ckpt.config.num_layers) if not r.optional}


def _default_plan(ckpt: Checkpoint, fmt: str, targets: dict[str, Lazy], opts: Options, notes: list[str]) -> Plan:
    if fmt == "meta":
        n = opts.shards or 1
        container = ckpt.family.meta_container
        if n == 1 and container == "safetensors":
            order = library_order([(k, t.dtype, t.shape) for k, t in targets.items()])
            files = [FilePlan(meta.SAFETENSORS_FILE, order, None)]
        else:
            files = [FilePlan(meta.rank_file(r), list(targets), rank=r, ranks=n) for r in range(n)]
        split: dict[str, int | None] = {}
        if n > 1:
            for k, t in targets.items():
                d = meta.split_dim(k, len(t.shape), ckpt.family.vocab_parallel)
                if d is not None and t.shape[d] % n:
                    raise CkptkitError(
                        f"--shards {n}: {k} has {t.shape[d]} rows/columns on dim {d}, not divisible by {n}"
                    )
                split[k] = d
        return Plan(fmt, targets, files, split, notes=notes)
    if opts.shards is not None:
        raise CkptkitError("--shards applies to --to meta (model-parallel ranks); use --max-shard-size for HF formats")
    if fmt == "internal":
        pattern, single = internal.PATTERN, internal.SINGLE
    else:
        pattern, single = hf.shard_pattern(fmt), hf.single_name(fmt)
    try:
        split_result = split_state_dict_into_shards_factory(
            targets,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern=pattern,
            max_shard_size=opts.max_shard_size or DEFAULT_MAX_SHARD,
            get_storage_id=lambda t: None,
        )
    except ValueError as e:
        raise CkptkitError(f"--max-shard-size: {e}") from None
    metadata = {"format": "pt"} if fmt in ("hf", "internal") else None
    files = []
    for name, keys in split_result.filename_to_tensors.items():
        if fmt in ("hf", "internal"):  # safetensors data order, as the library writes it
            keys = library_order([(k, targets[k].dtype, targets[k].shape) for k in keys])
        files.append(FilePlan(single if not split_result.is_sharded else name, keys, metadata))
    return Plan(fmt, targets, files, notes=notes)


def _metadata_files(ckpt: Checkpoint, plan: Plan, cast: str | None) -> dict[str, str]:
    """config.json / params.json / index / ckptkit.json texts for the output."""
    fmt, cfg, origin = plan.format, ckpt.config, ckpt.origin
    out: dict[str, str] = {}
    weights = list(plan.targets.values())
    main_dtype = max(weights, key=lambda t: t.nbytes).dtype if weights else "float32"
    recorded = (origin.get("config") or {}) if plan.restored else {}
    if fmt == "internal":
        return {}  # written by _write_internal_json, which needs the final file list
    if fmt == "meta":
        if recorded.get("name") == "params.json":
            out["params.json"] = recorded["text"]
        else:
            out["params.json"] = json.dumps(ckpt.family.config_to_meta(cfg)) + "\n"
        return out
    if recorded.get("name") == "config.json":
        text = recorded["text"]
        if cast is not None:
            doc = json.loads(text)
            for key in ("dtype", "torch_dtype"):
                if key in doc:
                    doc[key] = main_dtype
            text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
        out["config.json"] = text
    else:
        out["config.json"] = json.dumps(ckpt.family.config_to_hf(cfg, main_dtype), indent=2, sort_keys=True) + "\n"
    if len(plan.files) > 1:
        index = origin.get("index") if plan.restored else None
        if index and cast is None:
            out[index["name"]] = index["text"]
        else:
            weight_map = {k: f.name for f in plan.files for k in f.keys}
            total = sum(plan.targets[k].nbytes for k in weight_map)
            params = sum(math.prod(plan.targets[k].shape) for k in weight_map)
            out[hf.index_name(fmt)] = hf.index_text(fmt, dict(sorted(weight_map.items())), total, params)
    return out


# --- writing -------------------------------------------------------------------------


def write_plan(plan: Plan, out_dir: Path, quiet: bool = False, label: str = "converting") -> None:
    """Stream every target tensor into the output files."""
    writers: dict[str, Any] = {}
    where: dict[str, list[FilePlan]] = {}
    for f in plan.files:
        entries = []
        for k in f.keys:
            shape = plan.targets[k].shape
            d = plan.split_dims.get(k)
            if f.ranks > 1 and d is not None:
                shape = tuple(s // f.ranks if i == d else s for i, s in enumerate(shape))
            entries.append((k, plan.targets[k].dtype, tuple(shape)))
            where.setdefault(k, []).append(f)
        path = out_dir / f.name
        writers[f.name] = (
            SafetensorsWriter(path, entries, f.metadata)
            if f.name.endswith(".safetensors")
            else TorchPickleWriter(path, entries)
        )
    total = sum(plan.targets[k].nbytes for k in where)
    with byte_progress(label, total, quiet) as bar:
        for key, files in where.items():
            lazy = plan.targets[key]
            tensor = lazy.get()
            if tuple(tensor.shape) != tuple(lazy.shape) or dtype_name(tensor.dtype) != lazy.dtype:
                raise RuntimeError(f"{key}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {lazy.shape}")
            pieces = split_ranks(tensor, files[0].ranks, plan.split_dims.get(key)) if files[0].ranks > 1 else [tensor]
            for f in files:
                writers[f.name].write(key, pieces[f.rank] if len(pieces) > 1 else pieces[0])
            del tensor, pieces
            bar.advance(lazy.nbytes)
    for w in writers.values():
        w.close()
    for name, text in plan.metadata_files.items():
        (out_dir / name).write_text(text, encoding="utf-8")


def _write_origin_files(ckpt: Checkpoint, plan: Plan, out_dir: Path) -> None:
    origin = ckpt.origin
    if plan.format == "internal":
        doc = {
            "format": "internal",
            "version": internal.VERSION,
            "model_type": ckpt.family.name,
            "config": ckpt.config.to_dict(),
            "files": {f.name: f.keys for f in plan.files},
            "origin": origin,
        }
        (out_dir / INTERNAL_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    elif not plan.restored and origin.get("format") not in (None, plan.format):
        sizes = {f.name: (out_dir / f.name).stat().st_size for f in plan.files}
        doc = {"written": {"format": plan.format, "files": sizes}, "origin": origin}
        (out_dir / ORIGIN_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


# --- the command ---------------------------------------------------------------------


def check_destination(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise CkptkitError(f"{dst}: the destination may not be the source or lie inside it")
    if d in s.parents:
        raise CkptkitError(f"{dst}: the destination contains the source; choose another directory")
    if dst.exists():
        if not dst.is_dir():
            raise CkptkitError(f"{dst}: exists and is not a directory")
        if any(dst.iterdir()) and not force:
            raise CkptkitError(f"{dst}: exists and is not empty (pass --force to replace it)")


@dataclass
class Result:
    plan: Plan
    notes: list[str]
    bytes_written: int


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    from_format: str | None = None,
    model_type: str | None = None,
    dtype: str | None = None,
    shards: int | None = None,
    max_shard_size: str | None = None,
    force: bool = False,
    verify: bool = False,
    quiet: bool = True,
    on_verify: Callable[[Any], None] | None = None,
) -> Result:
    """Convert ``src`` into ``dst`` in format ``to``; ``dst`` is complete or absent afterwards."""
    src, dst = Path(src), Path(dst)
    if dtype is not None and dtype not in CAST_TARGETS:
        raise CkptkitError(f"--dtype must be one of {', '.join(CAST_TARGETS)}, not {dtype!r}")
    if shards is not None and shards < 1:
        raise CkptkitError("--shards must be at least 1")
    if to not in FORMATS:
        raise CkptkitError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    with open_checkpoint(src, from_format, model_type) as ckpt:
        check_destination(src, dst, force)
        return write_checkpoint(ckpt, dst, Options(to, dtype, shards, max_shard_size), verify, quiet, on_verify)


def write_checkpoint(
    ckpt: Checkpoint,
    dst: Path,
    opts: Options,
    verify: bool = False,
    quiet: bool = True,
    on_verify: Callable[[Any], None] | None = None,
) -> Result:
    """Write ``ckpt`` to ``dst`` through a temporary directory renamed at the end."""
    plan = plan_conversion(ckpt, opts)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".ckptkit-tmp", dir=dst.parent))
    try:
        write_plan(plan, tmp, quiet)
        _write_origin_files(ckpt, plan, tmp)
        for extra in ckpt.extra_files():
            shutil.copy2(extra, tmp / extra.name)
        if verify:
            from ckptkit.verify import verify_against

            report = verify_against(ckpt, tmp, opts.dtype, quiet=quiet)
            if on_verify:
                on_verify(report)
            if not report.ok:
                raise CkptkitError(f"{dst}: verification failed: {report.summary()}")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    return Result(plan, ckpt.notes + plan.notes, written)
