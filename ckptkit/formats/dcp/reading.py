"""A DCP folder's tensors, stitched from their chunks.

Each chunk is its own ``torch.save`` zip, whose members
:mod:`ckptkit.formats.pickle_index` checks and scans without torch; a tensor's bytes are
then the chunks' data records, stitched in row-major order as byte ranges
(:class:`~ckptkit.io.Span`, :func:`stitch`), so a conversion copies them file to file with no
tensor in memory, or reads one tensor at a time (:meth:`DcpCheckpoint.read`). A chunk whose
pickle the scanner does not know is loaded by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import itertools
import math
import struct
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import RawCheckpoint
from ckptkit.formats.dcp.metadata import Chunk, Entry
from ckptkit.formats.pickle_index import ForbiddenGlobal, TensorMeta, UnsupportedPickle, check_members, scan_tensor
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import (
    RecordCheck,
    Span,
    Verifier,
    Window,
    coalesce,
    open_source,
    read_at,
    read_spans,
    take,
    total_bytes,
)
from ckptkit.tensors.dtypes import ITEMSIZE, tensor_bytes, to_torch

if TYPE_CHECKING:
    import torch


@dataclass
class _Stored:
    """A chunk as stored: its bytes as one span (None: not row-major in one record)."""

    span: Span | None


@dataclass
class DcpCheckpoint(RawCheckpoint):
    """A DCP folder's model tensors (by Meta name), stitched from their chunks on read."""

    entries: dict[str, Entry] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    _stored: dict[tuple[str, int], _Stored] = field(default_factory=dict)
    _verifiers: dict[str, Verifier] = field(default_factory=dict)

    def _verifier(self, file: str) -> Verifier:
        if file not in self._verifiers:
            path = self.root / file

            def fail(key: str) -> CkptkitError:
                at, _, record = key.partition(":")
                why = f"record data/{record} of the chunk at byte {at} fails its CRC-32 check"
                return CkptkitError(f"{path}: {why}: the file is corrupt")

            self._verifiers[file] = Verifier(path, fail)
        return self._verifiers[file]

    def _chunk(self, entry: Entry, chunk: Chunk) -> _Stored:
        key = (chunk.file, chunk.offset)
        if key not in self._stored:
            self._stored[key] = self._index_chunk(entry, chunk)
        return self._stored[key]

    def _bad(self, entry: Entry, chunk: Chunk, why: str) -> CkptkitError:
        where = f"bytes {chunk.offset}..{chunk.offset + chunk.length}"
        return CkptkitError(f"{self.root / chunk.file}: the chunk of {entry.fqn!r} at {where} {why}")

    def _index_chunk(self, entry: Entry, chunk: Chunk) -> _Stored:
        path = self.root / chunk.file
        src = open_source(path)
        try:
            window = Window(src, chunk.offset, chunk.length)
            try:
                with zipfile.ZipFile(window) as z:
                    if any(zi.header_offset < 0 for zi in z.infolist()):  # an archive that starts before the chunk
                        raise ValueError("member before the start")
                    prefix, members, offsets = check_members(path, z, window, chunk.length)  # type: ignore[arg-type]
                    data = z.read(members[f"{prefix}/data.pkl"])
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error):
                raise self._bad(entry, chunk, "is not a torch.save archive (truncated file or wrong offsets)") from None
        finally:
            src.close()
        try:
            meta = scan_tensor(data)
        except ForbiddenGlobal as e:
            raise self._bad(entry, chunk, f"imports {e}: refusing to load it") from None
        except (UnsupportedPickle, ValueError, IndexError, KeyError, TypeError, AttributeError):
            return _Stored(None)  # an unusual pickle: torch.load (weights_only) reads the chunk
        if meta.dtype != entry.dtype or meta.shape != chunk.sizes:
            raise self._bad(
                entry, chunk, f"holds {meta.dtype} {list(meta.shape)}, .metadata says {entry.dtype} {list(chunk.sizes)}"
            )
        name = f"{prefix}/data/{meta.storage}"
        zi = members.get(name)
        itemsize = ITEMSIZE[meta.dtype]
        inside = meta.offset >= 0 and meta.end <= meta.storage_numel
        if zi is None or zi.file_size != meta.storage_numel * itemsize or not inside:
            raise self._bad(entry, chunk, "has a tensor outside its storage record (corrupt archive)")
        if not _row_major(meta):
            return _Stored(None)
        start = chunk.offset + offsets[name]
        nbytes = math.prod(meta.shape) * itemsize
        check = RecordCheck(self._verifier(chunk.file), f"{chunk.offset}:{meta.storage}", start, zi.file_size, zi.CRC)
        whole = zi.CRC if meta.offset == 0 and nbytes == zi.file_size else None
        return _Stored(Span(path, start + meta.offset * itemsize, nbytes, whole, check))

    def _chunk_tensor(self, entry: Entry, chunk: Chunk) -> torch.Tensor:
        import torch

        stored = self._chunk(entry, chunk)
        dtype = to_torch(entry.dtype)
        if stored.span is None:
            return self._loaded_chunk(entry, chunk).to(dtype).contiguous()
        span = stored.span
        if span.nbytes == 0:
            return torch.empty(chunk.sizes, dtype=dtype)
        try:
            buf = bytearray(read_spans([span]))  # its record's CRC-32 checked first
        except EOFError:
            raise self._bad(entry, chunk, "is cut short: the file is truncated") from None
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(chunk.sizes)

    def _loaded_chunk(self, entry: Entry, chunk: Chunk) -> torch.Tensor:
        import torch

        src = open_source(self.root / chunk.file)
        try:
            data = read_at(src, chunk.offset, chunk.length)
        except EOFError:
            raise self._bad(entry, chunk, "is cut short: the file is truncated") from None
        finally:
            src.close()
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # what torch.load raises on damaged archives varies
            raise self._bad(entry, chunk, f"cannot be loaded ({type(e).__name__})") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != chunk.sizes or str(t.dtype) != f"torch.{entry.dtype}":
            raise self._bad(entry, chunk, "does not hold the tensor .metadata describes")
        return t

    def read(self, name: str) -> torch.Tensor:
        """One tensor, its chunks stitched (the full tensor and one chunk in memory)."""
        import torch

        entry = self.entries[name]
        chunks = [c for c in entry.chunks if c.numel]
        if len(chunks) == 1:
            return self._chunk_tensor(entry, chunks[0]).reshape(entry.shape)
        out = torch.empty(entry.shape, dtype=to_torch(entry.dtype))
        for c in chunks:
            part = self._chunk_tensor(entry, c)
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))].copy_(part)
            del part
        return out

    def spans(self, name: str) -> list[Span] | None:
        """The tensor's bytes in row-major order as ranges of the chunks' data records."""
        entry = self.entries[name]
        chunks = [c for c in entry.chunks if c.numel]
        stored = [self._chunk(entry, c).span for c in chunks]
        if any(s is None for s in stored):
            return None
        return coalesce(stitch(entry.shape, ITEMSIZE[entry.dtype], list(zip(chunks, stored, strict=True))))  # type: ignore[arg-type]

    def sample(self, name: str, nbytes: int) -> bytes:
        spans = self.spans(name)
        if spans is None:
            return bytes(tensor_bytes(self.read(name))[:nbytes])
        return read_spans(take(spans, 0, min(nbytes, total_bytes(spans))))


def _row_major(meta: TensorMeta) -> bool:
    if meta.stride is None:
        return False
    expected = 1
    for size, step in zip(reversed(meta.shape), reversed(meta.stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def stitch(shape: tuple[int, ...], itemsize: int, chunks: list[tuple[Chunk, Span]]) -> list[Span]:
    """The byte ranges of the chunks' spans that make up the whole tensor in row-major order
    (the chunks tile it: :func:`check_tiling`)."""
    if len(chunks) == 1:
        return [chunks[0][1]]
    # k: the last dim some chunk does not span whole; past it every chunk row is contiguous.
    k = max(d for d in range(len(shape)) if any(c.sizes[d] != shape[d] for c, _ in chunks))
    inner = math.prod(shape[k + 1 :]) * itemsize
    out: list[Span] = []
    ordered = sorted(chunks, key=lambda cs: cs[0].offsets[k])
    for idx in itertools.product(*(range(n) for n in shape[:k])):
        for c, span in ordered:
            if not all(c.offsets[d] <= idx[d] < c.offsets[d] + c.sizes[d] for d in range(k)):
                continue
            row = 0
            for d in range(k):
                row = row * c.sizes[d] + idx[d] - c.offsets[d]
            run = c.sizes[k] * inner
            out.append(span.slice(row * run, run))
    return out


class FileInfos:
    """The tensors (chunks) one ``.distcp`` file holds, for ``inspect``."""

    def __init__(self, infos: dict[str, TensorInfo]) -> None:
        self.infos = infos

    def close(self) -> None:
        pass
