"""The streaming converter: source checkpoint -> target format, one tensor at a time.

For each target tensor it fetches the canonical tensors it needs from the source,
applies the target format's transform, casts if asked, and writes it into every file
that holds it (one file for HF shards, every rank for Meta). Output goes to a temporary
directory beside the destination, put in place at the end by :func:`ckptkit.io.publishing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.errors import CkptkitError, FlagError, note
from ckptkit.formats import REGISTRY, CheckpointFormat
from ckptkit.formats.containers import Entries
from ckptkit.formats.peft_adapter import ADAPTER_CONFIG, adapter_base, is_adapter_folder
from ckptkit.io import AUTO, COPY_METHODS, Overlap, check_replaceable, direct_pays, publishing, total_bytes
from ckptkit.plan import FilePlan, Options, Plan, check_experts_choice, plan_conversion, target_format
from ckptkit.progress import byte_progress
from ckptkit.tensors.dtypes import CAST_TARGETS, dtype_name
from ckptkit.tensors.transforms import RANKS
from ckptkit.untrusted import copy_regular_file

__all__ = [
    "COMPUTED", "Options", "Plan", "Result", "convert", "plan_conversion", "write_checkpoint", "write_files",
    "write_plan",
]  # fmt: skip

COMPUTED = "computed"  # bytes_by_method label of tensors materialised and written from memory


# --- writing -------------------------------------------------------------------------


def write_plan(
    plan: Plan, out_dir: Path, quiet: bool = False, label: str = "converting", copy_method: str | None = AUTO
) -> dict[str, int]:
    """Stream every target tensor into the output files.

    A tensor whose bytes the source holds as they are to be written (its lazy has spans:
    unchanged, or rows moved by a transform) is copied file to file on worker threads with
    ``copy_method`` (one of :data:`~ckptkit.io.COPY_METHODS`, or, for tests, a fallback of
    :data:`ckptkit.io.transfer.METHODS` forced; None: never), while this thread computes the
    others (casts, generated tensors: those with ``raw`` bytes, unless split across ranks,
    without torch). ``auto`` writes whole pages past the page cache when the output is
    larger than the kernel's dirty limit (:func:`~ckptkit.io.direct_pays`). Returns the
    bytes written by each method
    (:data:`COMPUTED` for those computed in memory).
    """
    where: dict[str, list[FilePlan]] = {}
    entries: dict[str, Entries] = {}
    for f in plan.files:
        for k in f.keys:
            shape = RANKS.shard_shape(plan.targets[k].shape, f.ranks, plan.split_dims.get(k))
            entries.setdefault(f.name, []).append((k, plan.targets[k].dtype, tuple(shape)))
            where.setdefault(k, []).append(f)
    total = sum(plan.targets[k].nbytes for k in where)
    direct = direct_pays(total)  # auto: whole pages past the page cache when the output is big
    fmt = target_format(plan.format)
    writers: dict[str, Any] = {}
    try:
        for f in plan.files:  # the format says which writer writes each file
            writers[f.name] = fmt.writer(out_dir / f.name, f, entries.get(f.name, []), direct)
        by_method = _write_tensors(plan, where, writers, total, label, quiet, copy_method)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():  # no descriptor outlives a failure (ENOSPC: blocks held)
            w.discard()
        raise
    for name, text in plan.metadata_files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return by_method


def _write_tensors(
    plan: Plan,
    where: dict[str, list[FilePlan]],
    writers: dict[str, Any],
    total: int,
    label: str,
    quiet: bool,
    copy_method: str | None,
) -> dict[str, int]:
    """The tensor loop of :func:`write_plan`: returns the bytes written by each method."""
    computed = 0
    with byte_progress(label, total, quiet) as bar, Overlap(on_done=bar.advance) as copies:
        for key, files in where.items():
            lazy = plan.targets[key]
            if all(key in f.aliases for f in files):  # stored as another tensor's storage
                bar.advance(lazy.nbytes)
                continue
            ranks, dim = files[0].ranks, plan.split_dims.get(key)
            spans = lazy.spans() if copy_method is not None else None
            if spans is not None:
                if total_bytes(spans) != lazy.nbytes:
                    raise RuntimeError(f"{key}: {total_bytes(spans)} stored bytes, planned {lazy.nbytes}")
                pieces = RANKS.inverse_spans(spans, lazy.shape, ranks, dim) if ranks > 1 else [spans]
                for f in files:
                    job = functools.partial(writers[f.name].write_spans, key, pieces[f.rank], copy_method)
                    copies.submit(job, total_bytes(pieces[f.rank]) if dim is not None or f is files[0] else 0)
                continue
            if lazy.raw is not None and (ranks == 1 or dim is None):  # bytes in memory: no torch
                data = lazy.raw()
                if len(data) != lazy.nbytes:
                    raise RuntimeError(f"{key}: produced {len(data)} bytes, planned {lazy.nbytes}")
                for f in files:
                    writers[f.name].write_bytes(key, data)
                computed += lazy.nbytes
                bar.advance(lazy.nbytes)
                continue
            tensor = lazy.get()
            if tuple(tensor.shape) != tuple(lazy.shape) or dtype_name(tensor.dtype) != lazy.dtype:
                raise RuntimeError(f"{key}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {lazy.shape}")
            parts = RANKS.inverse(tensor, ranks, dim) if ranks > 1 else [tensor]
            for f in files:
                writers[f.name].write(key, parts[f.rank] if len(parts) > 1 else parts[0])
            del tensor, parts
            computed += lazy.nbytes
            bar.advance(lazy.nbytes)
    by_method = dict(copies.bytes_by_label)
    if computed:
        by_method[COMPUTED] = computed
    return by_method


# --- the command ---------------------------------------------------------------------


def check_destination(src: Path, dst: Path, force: bool, folder: bool = True) -> None:
    """A one-line error for a DST under a regular file, the source itself, inside it or
    holding it, and (a folder DST) one that is not empty without ``force``."""
    blocking = next((p for p in dst.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CkptkitError(f"{dst}: {blocking} is a file, not a folder; choose a DST outside it")
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise CkptkitError(f"{dst}: the destination may not be the source or lie inside it")
    if d in s.parents:
        raise CkptkitError(f"{dst}: the destination contains the source; choose another directory")
    if folder:
        check_replaceable(dst, force)


@dataclass
class Result:
    plan: Plan
    notes: list[str]
    bytes_written: int
    bytes_by_method: dict[str, int] = field(default_factory=dict)  # copy method (or COMPUTED) -> bytes


SIZE_UNITS = "KB, MB, GB, TB (powers of 1000)"


def parse_size(text: str) -> int:
    """``--max-shard-size``: a number and a unit, as transformers takes it (``5GB``, ``500MB``)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(text)
    except ValueError:
        raise CkptkitError(
            f"--max-shard-size {text}: not a size; write a number and one of {SIZE_UNITS}, e.g. 5GB or 500MB"
        ) from None
    if size <= 0:
        raise CkptkitError(f"--max-shard-size {text}: must be more than 0 bytes, e.g. 5GB")
    return size


def check_options(
    fmt: CheckpointFormat, dtype: str | None, shards: int | None, max_shard_size: str | None, allow_lossy_cast: bool
) -> None:
    """Refuse options that contradict each other or the target format, in one line each."""
    if allow_lossy_cast and dtype is None:
        raise FlagError("--allow-lossy-cast only applies to a cast: add --dtype TYPE, or drop --allow-lossy-cast")
    size_formats = ", ".join(n for n, f in REGISTRY.items() if f.sharding == "size")
    rank_formats = ", ".join(n for n, f in REGISTRY.items() if f.sharding == "ranks")
    if max_shard_size is not None:
        if fmt.sharding != "size":
            instead = "; split it with --shards N" if fmt.sharding == "ranks" else ""
            raise FlagError(
                f"--max-shard-size applies to --to {size_formats}, not --to {fmt.name} "
                f"({'model-parallel ranks' if fmt.sharding == 'ranks' else 'one layout'}){instead}"
            )
        parse_size(max_shard_size)
    if shards is not None and fmt.sharding != "ranks":
        instead = "; limit shard size with --max-shard-size SIZE" if fmt.sharding == "size" else ""
        raise FlagError(f"--shards (model-parallel ranks) applies to --to {rank_formats}, not --to {fmt.name}{instead}")


def check_lossy(ckpt: Checkpoint, dtype: str | None) -> None:
    """Tensors the source holds only approximately (quantized) are read with an explicit
    --dtype, and the conversion says it is lossy."""
    lossy = ckpt.raw.lossy
    if not lossy:
        return
    kinds = ", ".join(sorted(set(lossy.values())))
    if dtype is None:
        raise CkptkitError(
            f"{ckpt.path}: {len(lossy)} tensors are quantized ({kinds}); dequantizing them is lossy: "
            "pass --dtype float32, bfloat16 or float16 to convert them anyway"
        )
    fact = (
        f"lossy: {len(lossy)} quantized tensors ({kinds}) dequantized to {dtype}, llama.cpp's approximations "
        "of the original weights, not the weights themselves"
    )
    ckpt.notes.append(note(fact))


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
    copy_method: str | None = AUTO,
    allow_lossy_cast: bool = False,
    config: str | Path | None = None,
    force_model_type: bool = False,
    experts: str | None = None,
    base: str | Path | None = None,
) -> Result:
    """Convert ``src`` into ``dst`` in format ``to``; ``dst`` is complete or absent afterwards.

    ``model_type`` that contradicts what the files say is refused unless ``force_model_type``.
    ``copy_method`` picks how tensors travel file to file (see :func:`write_plan`);
    ``config`` gives the model config of a source without one (``--config``); ``experts``
    (``per-expert`` / ``stacked``) how a mixture-of-experts model's experts are stored in
    ``dst`` (None: as in the source). A PEFT LoRA adapter folder ``src`` goes to a format
    that holds adapters (:func:`convert_adapter`), ``base`` its base checkpoint.
    """
    src, dst = Path(src), Path(dst)
    if copy_method is not None and copy_method not in COPY_METHODS:
        raise CkptkitError(f"--copy-method must be one of {', '.join(COPY_METHODS)}, not {copy_method!r}")
    fmt = target_format(to)
    if dtype is not None and dtype not in CAST_TARGETS + fmt.extra_dtypes:
        takers = [f.name for f in REGISTRY.values() if dtype in f.extra_dtypes]
        if takers:
            raise CkptkitError(f"--dtype {dtype} applies only to --to {' or '.join(takers)}")
        raise CkptkitError(f"--dtype must be one of {', '.join(CAST_TARGETS)}, not {dtype!r}")
    if shards is not None and shards < 1:
        raise CkptkitError("--shards must be at least 1")
    check_options(fmt, dtype, shards, max_shard_size, allow_lossy_cast)
    if src.is_dir() and is_adapter_folder(src):
        given = {"--from": from_format, "--model-type": model_type, "--config": config, "--experts": experts}
        return convert_adapter(src, dst, fmt, base, dtype, force, quiet, allow_lossy_cast, given, verify)
    if base is not None and src.exists():
        raise CkptkitError(f"--base applies to a LoRA adapter SRC (a folder with {ADAPTER_CONFIG}); {src} is not one")
    with open_checkpoint(src, from_format, model_type, config, check_model_type=not force_model_type) as ckpt:
        check_lossy(ckpt, dtype)
        check_experts_choice(ckpt, fmt, experts)
        if fmt.writes_file:  # one output file the format writes and publishes itself
            if verify:
                raise CkptkitError(f"--verify is not available for --to {fmt.name}; run ckptkit verify on the result")
            check_destination(src, dst, force, folder=False)
            written = fmt.write_file(ckpt, dst, dtype, quiet, force, allow_lossy_cast)
            return Result(Plan(fmt.name, {}, [FilePlan(dst.name, [])]), list(ckpt.notes), written, {COMPUTED: written})
        check_destination(src, dst, force)
        opts = Options(to, dtype, shards, max_shard_size, allow_lossy_cast, experts)
        return write_checkpoint(ckpt, dst, opts, verify, quiet, on_verify, copy_method, force=force)


def convert_adapter(
    src: Path,
    dst: Path,
    fmt: CheckpointFormat,
    base: str | Path | None,
    dtype: str | None,
    force: bool,
    quiet: bool,
    allow_lossy_cast: bool,
    given: dict[str, Any],
    verify: bool = False,
) -> Result:
    """The PEFT LoRA adapter folder ``src`` as ``fmt``'s adapter file ``dst`` (``base``: its base)."""
    if not fmt.writes_adapters:
        takers = " or ".join(f"--to {f.name}" for f in REGISTRY.values() if f.writes_adapters)
        raise CkptkitError(
            f"{src}: a LoRA adapter; --to {fmt.name} takes models. Convert the adapter {takers}, or fold it into "
            f"its base with ckptkit merge BASE {src} MERGED"
        )
    extra = next((flag for flag, value in given.items() if value is not None), "--verify" if verify else None)
    if extra is not None:
        raise FlagError(f"{extra} applies to checkpoints, not to a LoRA adapter SRC")
    check_destination(src, dst, force, folder=False)
    with open_checkpoint(adapter_base(src, Path(base) if base is not None else None)) as trained_on:
        written = fmt.write_adapter(src, dst, trained_on, dtype, quiet, force, allow_lossy_cast)
    return Result(Plan(fmt.name, {}, [FilePlan(dst.name, [])]), [], written, {COMPUTED: written})


def write_checkpoint(
    ckpt: Checkpoint,
    dst: Path,
    opts: Options,
    verify: bool = False,
    quiet: bool = True,
    on_verify: Callable[[Any], None] | None = None,
    copy_method: str | None = AUTO,
    force: bool = False,
) -> Result:
    """Write ``ckpt`` to ``dst`` (replaced only with ``force``), published atomically."""
    plan = plan_conversion(ckpt, opts)
    with publishing(dst, replace=force) as tmp:
        by_method = write_files(ckpt, plan, tmp, quiet, copy_method)
        if verify:
            from ckptkit.verify import verify_against

            report = verify_against(ckpt, tmp, opts.dtype, quiet=quiet)
            if on_verify:
                on_verify(report)
            if not report.ok:
                raise CkptkitError(f"{dst}: verification failed: {report.summary()}")
    written = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    return Result(plan, ckpt.notes + plan.notes, written, by_method)


def write_files(
    ckpt: Checkpoint, plan: Plan, folder: Path, quiet: bool = True, copy_method: str | None = AUTO
) -> dict[str, int]:
    """Every file of the converted checkpoint, into an existing (temporary) folder; returns
    the bytes written per copy method (see :func:`write_plan`)."""
    by_method = write_plan(plan, folder, quiet, copy_method=copy_method)
    target_format(plan.format).finish(ckpt, plan, folder)
    for extra in ckpt.extra_files():
        if extra.name not in plan.tokenizer.skip:
            copy_regular_file(extra, folder / extra.name)
    for name, data in plan.tokenizer.files.items():
        (folder / name).write_bytes(data)
    return by_method
