"""Header-first, streaming access to ``.safetensors`` files.

Reading parses and validates the header ourselves and reads each tensor with one
positioned read into a fresh buffer (no mmap: resident memory stays at one tensor).
Writing lays out the header up front, so tensors can be written one at a time, in any
order, and the result is byte-identical to what the ``safetensors`` library writes for
the same tensors, metadata and order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.writers import FileWriter
from ckptkit.io import SourceFile, Span, open_source, read_at, read_fully
from ckptkit.tensors.dtypes import SAFETENSORS_CODES, SAFETENSORS_DTYPES, dtype_name, to_torch
from ckptkit.untrusted import loads_json

if TYPE_CHECKING:
    import torch


MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_layout(path: Path) -> tuple[list[TensorInfo], dict[str, str] | None, int, dict[str, int]]:
    """Parse and validate a safetensors header.

    Returns:
        The tensors in data order, the ``__metadata__`` dict, the offset where data starts
        and each tensor's offset in the data section. Raises CkptkitError naming the file
        when the header is damaged.
    """
    src = open_source(path)
    try:
        size = src.size()
        if size < 8:
            raise CkptkitError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", read_at(src, 0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CkptkitError(f"{path}: truncated or corrupt safetensors header (header length {n}, file size {size})")
        raw = bytes(read_at(src, 8, n))
    except OSError as e:
        raise CkptkitError(f"{path}: cannot read: {e.strerror}") from None
    except EOFError:
        raise CkptkitError(f"{path}: truncated or corrupt safetensors header (the file changed)") from None
    finally:
        src.close()
    header = parse_header_json(path, raw)
    metadata = header.pop("__metadata__", None)
    check_metadata(path, metadata)
    data_start = 8 + n
    placed = check_layout(path, header, size - data_start)
    return [info for _, info in placed], metadata, data_start, {info.name: begin for begin, info in placed}


# --- validation, as strict as the safetensors library --------------------------------------


def parse_header_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header's JSON object; refuses invalid UTF-8/JSON, NaN, deep nesting, repeated names."""
    if not raw.startswith(b"{"):
        raise CkptkitError(f"{path}: corrupt safetensors header (does not start with '{{')")
    header = loads_json(raw, path, "corrupt safetensors header", unique_keys=True)
    if not isinstance(header, dict):
        raise CkptkitError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header


def check_metadata(path: Path, metadata: object) -> None:
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CkptkitError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")


def _entry(path: Path, name: str, entry: object) -> tuple[int, int, TensorInfo]:
    bad = CkptkitError(f"{path}: corrupt safetensors header entry for tensor {name!r}")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise bad
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise bad
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int and x >= 0 for x in offsets)):
        raise bad
    begin, end = offsets
    if begin > end:
        raise CkptkitError(f"{path}: invalid offset for tensor {name!r} ({begin}..{end})")
    return begin, end, TensorInfo(name, tuple(shape), SAFETENSORS_DTYPES[dtype], path.name)


def check_layout(path: Path, header: dict[str, Any], data_len: int) -> list[tuple[int, TensorInfo]]:
    """Each tensor's (offset, info) in data order, after checking that the tensors tile the
    data section exactly: sorted, contiguous, non-overlapping, each ``shape x itemsize``
    bytes, ending where the file ends."""
    entries = sorted((_entry(path, name, e) for name, e in header.items()), key=lambda x: (x[0], x[1]))
    expected = 0
    for begin, end, info in entries:
        if begin != expected:
            what = "overlaps the previous tensor" if begin < expected else f"leaves a gap of {begin - expected} bytes"
            raise CkptkitError(f"{path}: invalid offset for tensor {info.name!r}: it {what} (offsets {begin}..{end})")
        if end - begin != info.nbytes:
            raise CkptkitError(
                f"{path}: tensor {info.name!r} has the wrong size: {end - begin} bytes at offsets {begin}..{end}, "
                f"but shape {list(info.shape)} of {info.dtype} needs {info.nbytes}"
            )
        expected = end
    if expected != data_len:
        raise CkptkitError(
            f"{path}: the tensors cover {expected} bytes but the data section holds {data_len}: "
            "the file is truncated or corrupt"
        )
    return [(begin, info) for begin, _, info in entries]


class SafetensorsReader:
    """Lazy reader of one safetensors file: a header parse, then one read per tensor."""

    def __init__(self, path: Path):
        self.path = path
        infos, self.metadata, self._data_start, self._offsets = read_layout(path)
        self.infos = {i.name: i for i in infos}
        self.aliases: dict[str, str] = {}  # a safetensors file shares no storage between tensors
        self._file: SourceFile | None = None

    def _source(self) -> SourceFile:
        if self._file is None:
            self._file = open_source(self.path)
        return self._file

    def read(self, name: str) -> torch.Tensor:
        import torch

        info = self.infos[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        try:
            read_fully(self._source(), buf.numpy().data, self._data_start + self._offsets[name])
        except EOFError:
            raise CkptkitError(f"{self.path}: unexpected end of file reading {name!r}") from None
        return buf.view(to_torch(info.dtype)).reshape(info.shape)

    def span(self, name: str) -> Span:
        """Where a tensor's bytes lie in this file."""
        return Span(self.path, self._data_start + self._offsets[name], self.infos[name].nbytes)

    def sample(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of a tensor's data."""
        info = self.infos[name]
        return bytes(read_at(self._source(), self._data_start + self._offsets[name], min(nbytes, info.nbytes)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# The safetensors library sorts data by its dtype enum, descending, then by name.
_LIBRARY_RANK = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"]


def library_order(entries: list[tuple[str, torch.dtype | str, tuple[int, ...]]]) -> list[str]:
    """The data order the safetensors library writes: by dtype (its enum order, largest
    first), then by name."""
    rank = {name: -_LIBRARY_RANK.index(SAFETENSORS_CODES[dtype_name(dtype)]) for name, dtype, _ in entries}
    return sorted(rank, key=lambda name: (rank[name], name))


class SafetensorsWriter(FileWriter):
    """Writes one safetensors file whose layout is fixed up front.

    Args:
        path: file to create.
        entries: (name, dtype, shape) for every tensor, in data order.
        metadata: the ``__metadata__`` strings, or None for none.
        direct: whether ``auto`` copies write whole pages with ``O_DIRECT``
            (:class:`ckptkit.io.OutputFile`; ``direct`` copies always do).
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, torch.dtype | str, tuple[int, ...]]],
        metadata: dict[str, str] | None,
        direct: bool = False,
    ):
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = metadata
        offset = 0
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, dtype, shape in entries:
            nbytes = TensorInfo(name, tuple(shape), dtype_name(dtype)).nbytes
            header[name] = {
                "dtype": SAFETENSORS_CODES[dtype_name(dtype)],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._offsets[name] = (offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._pending = set(self._offsets)
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(self._data_start + offset)
        super().__init__(path, direct)

    def _place(self, name: str) -> tuple[int, int]:
        offset, nbytes = self._offsets[name]
        return self._data_start + offset, nbytes

    def _done(self, name: str, crc: int | None) -> None:
        self._pending.discard(name)

    def _finish(self) -> None:
        if self._pending:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")
