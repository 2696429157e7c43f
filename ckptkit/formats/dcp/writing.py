"""Writing a DCP folder: Meta-named tensors (torchtitan's), each chunk a ``torch.save``
archive laid out without torch (:func:`ckptkit.formats.torch_zip.write_archive`) and filled
in place (its CRC-32s patched in at the end), ``--shards N`` files split on dim 0 as N FSDP
ranks save them, and ``.metadata`` pickled from torch's own classes
(:func:`metadata_bytes`): ``torch.distributed.checkpoint.load`` reads it in one process
without a process group.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import Plan
from ckptkit.formats.pickle_index import BYTE_DTYPES
from ckptkit.formats.torch_zip import STORAGE_OF, pickle_tensor, write_archive
from ckptkit.formats.writers import FileWriter
from ckptkit.io import OutputFile
from ckptkit.tensors.dtypes import ITEMSIZE, dtype_name, to_torch

if TYPE_CHECKING:
    pass

ARCHIVE = "archive"  # the folder name torch.save gives an archive written to a stream


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


class _At:
    """A write-only file positioned from ``base`` of ``fd`` (None: only counts positions)."""

    def __init__(self, out: OutputFile | None, base: int) -> None:
        self._out, self._base, self._pos = out, base, 0

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos
        return self._pos

    def write(self, data: bytes) -> int:
        if self._out is not None:
            self._out.write(data, self._base + self._pos, writeback=False)
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class Place:
    """Where one chunk's archive and its data record lie in a ``.distcp`` file."""

    offset: int
    length: int
    data_offset: int
    nbytes: int
    header_offset: int  # the data record's local header
    central_offset: int  # its central directory entry


def lay_out(out: OutputFile | None, entries: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, Place]:
    """Write (``out``) or just compute (None) one archive per tensor, back to back, data
    left as holes; where each lies."""
    places: dict[str, Place] = {}
    end = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        f = _At(out, end)
        records = write_archive(f, ARCHIVE, pickle_tensor(dtype, shape), [nbytes])  # type: ignore[arg-type]
        data = next(r for r in records if r.name == "data/0")
        length = f.tell()
        places[name] = Place(
            end, length, end + data.data_offset, nbytes, end + data.header_offset, end + data.central_offset
        )
        end += length
    return places


class DistcpWriter(FileWriter):
    """One ``__R_0.distcp`` file: a ``torch.save`` archive per tensor, filled in place."""

    want_crc = True  # each archive's CRC-32, patched in at the end
    unit = "chunk"

    def __init__(self, path: Path, entries: list[tuple[str, Any, tuple[int, ...]]], direct: bool = False) -> None:

        named = [(n, dtype_name(d), tuple(s)) for n, d, s in entries]
        odd = [d for _, d, _ in named if d not in STORAGE_OF and d not in BYTE_DTYPES]
        if odd:
            raise CkptkitError(f"{path.name}: dtype {odd[0]} cannot be written to a DCP checkpoint")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        super().__init__(path, direct)
        self.places = lay_out(self._out, named)
        self._crcs: dict[str, int] = {}

    def _place(self, name: str) -> tuple[int, int]:
        place = self.places[name]
        return place.data_offset, place.nbytes

    def _done(self, name: str, crc: int | None) -> None:
        assert crc is not None
        self._crcs[name] = crc

    def _finish(self) -> None:
        missing = [n for n in self.places if n not in self._crcs]
        if missing:
            raise RuntimeError(f"{self.path}: tensors never written: {missing[:5]}")
        for name, crc in self._crcs.items():
            raw = crc.to_bytes(4, "little")
            self._out.write(raw, self.places[name].header_offset + 14, writeback=False)
            self._out.write(raw, self.places[name].central_offset + 16, writeback=False)


def metadata_bytes(plan: Plan) -> bytes:
    """``.metadata`` for the planned files, pickled from torch's own classes (what
    ``dcp.save`` writes: no storage_meta, flat planner data)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks: dict[str, list[ChunkStorageMetadata]] = {k: [] for k in plan.targets}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for f in plan.files:
        entries = plan.entries(f)
        places = lay_out(None, entries)
        for name, _, shard in entries:
            d = plan.split_dims.get(name) if f.ranks > 1 else None
            offsets = tuple(f.rank * shard[i] if i == d else 0 for i in range(len(shard)))
            index = len(chunks[name])
            chunks[name].append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(shard)))
            p = places[name]
            storage[MetadataIndex(name, torch.Size(offsets), index)] = _StorageInfo(f.name, p.offset, p.length)
    sd: dict[str, Any] = {
        k: TensorStorageMetadata(TensorProperties(dtype=to_torch(t.dtype)), torch.Size(t.shape), chunks[k])
        for k, t in plan.targets.items()
    }
    md = Metadata(sd, planner_data={k: (k,) for k in plan.targets}, storage_data=storage, version="1.0.0")
    return pickle.dumps(md)
