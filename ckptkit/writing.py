"""The write engine: every target tensor of a plan written into its files, one tensor at a
time, each by the way its bytes travel (copied file to file on worker threads, bytes or a
tensor from memory, a piece or a chunk at a time while the next is made), and the
temporary output it is written into (:func:`publishing_output`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from ckptkit.formats import CheckpointFormat
from ckptkit.formats.writers import Job, TensorWriter
from ckptkit.io import AUTO, DIRECT, STREAM, Overlap, direct_pays, publishing, publishing_file, total_bytes
from ckptkit.plan import FilePlan, Plan, target_format
from ckptkit.progress import byte_progress
from ckptkit.tensors.dtypes import dtype_name
from ckptkit.tensors.transforms import RANKS

__all__ = ["COMPUTED", "publishing_output", "write_plan"]

COMPUTED = "computed"  # bytes_by_method label of tensors materialised and written from memory


def write_plan(
    plan: Plan, out: Path, quiet: bool = False, label: str = "converting", copy_method: str | None = AUTO
) -> dict[str, int]:
    """Write every target tensor of ``plan`` into its files: under the folder ``out``, or
    ``out`` itself for a format whose output is one file.

    A tensor whose bytes the source holds as they are to be written (its lazy has spans:
    unchanged, or rows moved by a transform) is copied file to file on worker threads with
    ``copy_method`` (one of :data:`~ckptkit.io.COPY_METHODS`, or, for tests, a fallback of
    :data:`ckptkit.io.transfer.METHODS` forced; None: never), while this thread computes the
    others (casts, generated tensors: those with ``raw`` bytes, unless split across ranks,
    without torch; a writer that makes a tensor's bytes itself, a chunk at a time, has each
    chunk written on the workers while the next is made). ``auto`` writes whole pages past
    the page cache when the output is larger than the kernel's dirty limit or holds
    dequantized weights of some size (:func:`~ckptkit.io.direct_pays`). Returns the bytes
    written by each method (:data:`COMPUTED` for those computed in memory).
    """
    where: dict[str, list[FilePlan]] = {}
    for f in plan.files:
        for k in f.keys:
            where.setdefault(k, []).append(f)
    total = sum(plan.nbytes(k) for k in where)
    made = sum(plan.nbytes(k) for k, files in where.items() if _by_pieces(plan, k, files))
    # auto: whole pages past the page cache (a big output, dequantized weights); direct: always; stream: never
    direct = copy_method == DIRECT or (copy_method != STREAM and direct_pays(total, made))
    fmt = target_format(plan.format)
    writers: dict[str, TensorWriter] = {}
    try:
        for f in plan.files:  # the format says which writer writes each file
            writers[f.name] = plan.writer(out if fmt.info.file_suffix else out / f.name, f, direct)
        by_method = _write_tensors(plan, where, writers, total, label, quiet, copy_method)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():  # no descriptor outlives a failure (ENOSPC: blocks held)
            w.discard()
        raise
    return by_method


def _write_tensors(
    plan: Plan,
    where: dict[str, list[FilePlan]],
    writers: dict[str, TensorWriter],
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
            if copy_method is not None and (spans := lazy.spans()) is not None:
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
            chunks = writers[files[0].name].chunks(key, lazy) if len(files) == 1 else None
            if chunks is not None:  # made by the writer a chunk at a time, each written on a worker
                for write, nbytes in chunks:
                    copies.submit(functools.partial(_computed, write), nbytes)
                continue
            if lazy.pieces is not None and _by_pieces(plan, key, files):  # a piece at a time
                submit = functools.partial(_submit_computed, copies)
                writers[files[0].name].write_pieces(key, lazy.pieces, submit)
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
        by_method[COMPUTED] = by_method.get(COMPUTED, 0) + computed
    return by_method


def _by_pieces(plan: Plan, key: str, files: list[FilePlan]) -> bool:
    """Whether target ``key`` (in ``files``) is written a piece at a time as it is made
    (:attr:`Lazy.pieces`: one file, not split across ranks), if no faster way takes it first."""
    whole = files[0].ranks == 1 or plan.split_dims.get(key) is None
    return plan.targets[key].pieces is not None and len(files) == 1 and whole


def _computed(write: Job) -> str:
    write()
    return COMPUTED


def _submit_computed(copies: Overlap, write: Job, nbytes: int) -> Future[str]:
    return copies.submit(functools.partial(_computed, write), nbytes)


@contextmanager
def publishing_output(fmt: CheckpointFormat, dst: Path, force: bool) -> Iterator[Path]:
    """A temporary output beside ``dst`` (a folder, or one file for a format whose output is
    one), fsynced and put in place of ``dst`` when the block succeeds (:mod:`ckptkit.io`)."""
    with (publishing_file if fmt.info.file_suffix else publishing)(dst, force) as tmp:
        yield tmp
