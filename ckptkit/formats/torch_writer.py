"""Writing torch pickles (``.pth``/``.bin``) that ``torch.load`` reads, one tensor at a time.

The zip archive is laid out first (:mod:`ckptkit.formats.torch_zip` without torch, or
``torch.save`` of untouched placeholder tensors under ``torch.serialization.skip_data``),
then each tensor's bytes are filled in place and the archive's CRC-32 fields patched, so
no step holds more than one tensor.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckptkit.formats import torch_zip
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.writers import FileWriter
from ckptkit.io import AUTO, Span, crc32
from ckptkit.tensors.dtypes import dtype_name, to_torch

if TYPE_CHECKING:
    import torch


def save_torch(obj: object, path: Path, size_hint: int = 0) -> None:
    """``torch.save`` to ``path``; a failed write raises OSError with its cause.

    torch reports a failed write (full disk, file size limit) as a RuntimeError without
    the errno, and writing through a Python file object would change the archive's folder
    name. So after a failure one byte is written where the file would have ended (at
    least ``size_hint``), which fails again with the real errno (ENOSPC, EFBIG, EIO...).
    """
    import torch

    try:
        torch.save(obj, path)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "write failed"
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\0", max(os.fstat(fd).st_size, size_hint))
            finally:
                os.close(fd)
        except OSError as cause:
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise OSError(errno.EIO, f"torch.save failed ({first[:120]})", str(path)) from None


class TorchPickleWriter(FileWriter):
    """Writes one ``torch.save``-compatible file whose tensors are fixed up front.

    Args:
        path: file to create.
        entries: (name, dtype, shape) for every tensor, in dict order.
        aliases: name -> another entry whose storage it shares (as old ``save_pretrained``
            stored tied weights); written once, by that entry.
        direct: whether ``auto`` copies write whole pages with ``O_DIRECT``
            (:class:`ckptkit.io.OutputFile`; ``direct`` copies always do).
    """

    want_crc = True  # each record's CRC-32, patched into the zip at the end
    unit = "record"

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, torch.dtype | str, tuple[int, ...]]],
        aliases: dict[str, str] | None = None,
        direct: bool = False,
        facts: dict[str, str] | None = None,
    ):
        self.aliases = dict(aliases or {})
        named = [(name, dtype_name(dt), tuple(shape)) for name, dt, shape in entries]
        if torch_zip.supported([dtype for _, dtype, _ in named]) and not self.aliases:
            records = torch_zip.write_skeleton(path, named, facts)  # what torch.save writes, without torch
        else:
            records = _torch_skeleton(path, named, self.aliases, facts)
        by_name = {r.name: r for r in records}
        # Storage records are numbered in the order the pickler meets them: dict order.
        self._records: dict[str, tuple[int, int, str]] = {}
        for info in (TensorInfo(n, s, d) for n, d, s in named):
            owner = self.aliases.get(info.name, info.name)
            if owner in self._records:
                continue
            record = by_name[f"data/{len(self._records)}"]
            assert record.size == info.nbytes, (info.name, record.name)
            self._records[owner] = (record.data_offset, info.nbytes, record.name)
        self._zip = by_name  # record name -> where its local header and directory entry lie
        self._crcs: dict[str, int] = {}
        super().__init__(path, direct)

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Write a tensor's bytes (row-major) and record their CRC-32."""
        if name in self.aliases:
            return  # its bytes are those of the entry it aliases
        super().write_bytes(name, data)

    def write_spans(self, name: str, spans: list[Span], method: str = AUTO) -> str:
        """Copy a tensor's bytes file to file from ``spans`` (concatenated), with its CRC-32
        (the source record's, or computed on the way). Returns the copy method used.
        Thread-safe for distinct names."""
        if name in self.aliases:
            raise ValueError(f"{name}: stored as {self.aliases[name]}; its bytes are written with that tensor")
        return super().write_spans(name, spans, method)

    def _place(self, name: str) -> tuple[int, int]:
        offset, nbytes, _ = self._records[name]
        return offset, nbytes

    def _done(self, name: str, crc: int | None) -> None:
        assert crc is not None
        self._crcs[self._records[name][2]] = crc

    def _finish(self) -> None:
        missing = [n for n, (_, _, r) in self._records.items() if r not in self._crcs]
        if missing:
            raise RuntimeError(f"{self.path}: tensors never written: {missing[:5]}")
        for record, crc in self._crcs.items():
            packed = struct.pack("<I", crc)
            zrec = self._zip[record]  # torch leaves the local header's CRC 0: it is in the data descriptor
            self._out.write(packed, zrec.data_offset + zrec.size + 4, writeback=False)
            self._out.write(packed, zrec.central_offset + 16, writeback=False)


def _torch_skeleton(
    path: Path,
    entries: list[tuple[str, str, tuple[int, ...]]],
    aliases: dict[str, str] | None = None,
    facts: dict[str, str] | None = None,
) -> list[torch_zip.Record]:
    """The archive laid out by ``torch.save`` of untouched placeholders (for dtypes
    :mod:`torch_zip` cannot name, and for aliases: one placeholder under two names);
    every record with its offsets. ``facts``: the archive folder name and serialization id
    to restore (see :func:`torch_zip.write_skeleton`)."""
    import torch

    archive = (facts or {}).get("archive")
    if archive and archive != os.path.splitext(path.name)[0]:
        # torch names the archive folder after the file: save under that name, then move
        staging = Path(tempfile.mkdtemp(prefix=".ckptkit-zip-", dir=path.parent))
        try:
            records = _torch_skeleton(staging / f"{archive}.pt", entries, aliases, {**(facts or {}), "archive": ""})
            os.replace(staging / f"{archive}.pt", path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return records

    # Plain uninitialised tensors: skip_data writes no bytes, so their pages are never
    # touched (address space only), and no FakeTensorMode (it imports torch._dynamo).
    aliases = aliases or {}
    own = {name: torch.empty(shape, dtype=to_torch(dtype)) for name, dtype, shape in entries if name not in aliases}
    placeholders = {name: own[aliases.get(name, name)] for name, _, _ in entries}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.serialization.skip_data():
            save_torch(placeholders, path, size_hint=sum(t.nbytes for t in placeholders.values()))
    del placeholders
    reader = torch._C.PyTorchFileReader(str(path))
    records = []
    with zipfile.ZipFile(path) as z:
        pos = z.start_dir
        for zi in z.infolist():  # central directory entries, in archive order
            name = zi.filename.split("/", 1)[1]
            data_offset = reader.get_record_offset(name)  # type: ignore[attr-defined]
            records.append(torch_zip.Record(name, zi.header_offset, data_offset, zi.file_size, zi.CRC, pos))
            pos += 46 + len(zi.filename.encode()) + len(zi.extra) + len(zi.comment)
    ident = (facts or {}).get("serialization_id")
    if ident:
        _replace_record(path, next(r for r in records if r.name == ".data/serialization_id"), ident.encode())
    return records


def _replace_record(path: Path, record: torch_zip.Record, data: bytes) -> None:
    """Overwrite a small record of the same size with ``data`` and fix its CRC-32s (data
    descriptor and central directory; torch leaves the local header's 0)."""
    if len(data) != record.size:
        return  # a different length would move every later record: keep torch's
    packed = struct.pack("<I", crc32(data))
    with path.open("r+b") as f:
        f.seek(record.data_offset)
        f.write(data)
        f.seek(record.data_offset + record.size + 4)
        f.write(packed)
        f.seek(record.central_offset + 16)
        f.write(packed)
    record.crc = crc32(data)
