"""The streaming converter: source checkpoint -> target format, one tensor at a time.

For each target tensor it fetches the canonical tensors it needs from the source,
applies the target format's transform, casts if asked, and writes it into every file
that holds it (one file for HF shards, every rank for Meta). Output goes to a temporary
directory beside the destination, renamed into place at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.dtypes import CAST_TARGETS, dtype_name
from ckptkit.errors import CkptkitError
from ckptkit.formats.safetensors_io import SafetensorsWriter
from ckptkit.formats.torch_io import TorchPickleWriter
from ckptkit.plan import FilePlan, Options, Plan, plan_conversion, target_format
from ckptkit.progress import byte_progress
from ckptkit.transforms import RANKS

__all__ = ["Options", "Plan", "Result", "convert", "plan_conversion", "write_checkpoint", "write_plan"]


# --- writing -------------------------------------------------------------------------


def write_plan(plan: Plan, out_dir: Path, quiet: bool = False, label: str = "converting") -> None:
    """Stream every target tensor into the output files."""
    writers: dict[str, Any] = {}
    where: dict[str, list[FilePlan]] = {}
    for f in plan.files:
        entries = []
        for k in f.keys:
            shape = RANKS.shard_shape(plan.targets[k].shape, f.ranks, plan.split_dims.get(k))
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
            pieces = RANKS.inverse(tensor, files[0].ranks, plan.split_dims.get(key)) if files[0].ranks > 1 else [tensor]
            for f in files:
                writers[f.name].write(key, pieces[f.rank] if len(pieces) > 1 else pieces[0])
            del tensor, pieces
            bar.advance(lazy.nbytes)
    for w in writers.values():
        w.close()
    for name, text in plan.metadata_files.items():
        (out_dir / name).write_text(text, encoding="utf-8")


def replace_directory(tmp: Path, dst: Path) -> None:
    """Put the finished directory ``tmp`` in place of ``dst`` (the one publishing step;
    the trainer's checkpointer has its own, see ckptkit/train/checkpointer.py)."""
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


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
    target_format(to)
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
        target_format(plan.format).finish(ckpt, plan, tmp)
        for extra in ckpt.extra_files():
            shutil.copy2(extra, tmp / extra.name)
        if verify:
            from ckptkit.verify import verify_against

            report = verify_against(ckpt, tmp, opts.dtype, quiet=quiet)
            if on_verify:
                on_verify(report)
            if not report.ok:
                raise CkptkitError(f"{dst}: verification failed: {report.summary()}")
        replace_directory(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    return Result(plan, ckpt.notes + plan.notes, written)
