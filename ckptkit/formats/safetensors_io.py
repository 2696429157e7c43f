"""Header-first, streaming access to ``.safetensors`` files.

Reading parses and validates the header ourselves and reads each tensor with one
positioned read into a fresh buffer (no mmap: resident memory stays at one tensor).
Writing lays out the header up front, so tensors can be written one at a time, in any
order, and the result is byte-identical to what the ``safetensors`` library writes for
the same tensors, metadata and order.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.dtypes import SAFETENSORS_CODES, SAFETENSORS_DTYPES, dtype_name, to_torch
from ckptkit.errors import CkptkitError
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.rawcopy import AUTO, Span, copy_spans, total_bytes

if TYPE_CHECKING:
    import torch


MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str] | None, int]:
    """Parse and validate a safetensors header.

    Returns:
        The tensors in data order, the ``__metadata__`` dict and the offset where data
        starts. Raises CkptkitError naming the file when the header is damaged.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CkptkitError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CkptkitError(
                    f"{path}: truncated or corrupt safetensors header (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CkptkitError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CkptkitError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CkptkitError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    data_start = 8 + n
    data_len = size - data_start
    infos: list[tuple[int, TensorInfo]] = []
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CkptkitError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        info = TensorInfo(name, shape, dtype, path.name)
        if end - begin != info.nbytes or begin < 0 or end > data_len:
            raise CkptkitError(
                f"{path}: tensor {name!r} lies outside the file or has the wrong size "
                f"(offsets {begin}..{end}, data section {data_len} bytes): the file is truncated or corrupt"
            )
        infos.append((begin, info))
    infos.sort(key=lambda x: x[0])
    return [i for _, i in infos], metadata, data_start


class SafetensorsReader:
    """Lazy reader of one safetensors file: a header parse, then one read per tensor."""

    def __init__(self, path: Path):
        self.path = path
        infos, self.metadata, self._data_start = read_header(path)
        self.infos = {i.name: i for i in infos}
        self._offsets: dict[str, int] = {}
        offset = 0
        for info in infos:
            self._offsets[info.name] = offset
            offset += info.nbytes
        self._file = None

    def read(self, name: str) -> torch.Tensor:
        import torch

        info = self.infos[name]
        if self._file is None:
            self._file = self.path.open("rb", buffering=0)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        self._file.seek(self._data_start + self._offsets[name])
        view = memoryview(buf.numpy())
        got = 0
        while got < info.nbytes:
            n = self._file.readinto(view[got:])
            if not n:
                raise CkptkitError(f"{self.path}: unexpected end of file reading {name!r}")
            got += n
        return buf.view(to_torch(info.dtype)).reshape(info.shape)

    def span(self, name: str) -> Span:
        """Where a tensor's bytes lie in this file."""
        return Span(self.path, self._data_start + self._offsets[name], self.infos[name].nbytes)

    def sample(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of a tensor's data."""
        info = self.infos[name]
        with self.path.open("rb") as f:
            f.seek(self._data_start + self._offsets[name])
            return f.read(min(nbytes, info.nbytes))

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


class SafetensorsWriter:
    """Writes one safetensors file whose layout is fixed up front.

    Args:
        path: file to create.
        entries: (name, dtype, shape) for every tensor, in data order.
        metadata: the ``__metadata__`` strings, or None for none.
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype | str, tuple[int, ...]]],
        metadata: dict[str, str] | None,
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
        self.path = path
        self._data_start = 8 + len(raw)
        self._pending = set(self._offsets)
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        offset, nbytes = self._offsets[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == nbytes, (name, data.nbytes, nbytes)
        os.pwrite(self._file.fileno(), memoryview(data), self._data_start + offset)
        self._pending.discard(name)

    def write_spans(self, name: str, spans: list[Span], method: str = AUTO) -> str:
        """Copy a tensor's bytes file to file from ``spans`` (concatenated); returns the copy
        method used. Thread-safe for distinct names."""
        offset, nbytes = self._offsets[name]
        if total_bytes(spans) != nbytes:
            raise ValueError(f"{name}: spans of {total_bytes(spans)} bytes for a {nbytes}-byte tensor")
        fd = os.open(self.path, os.O_WRONLY)  # its own file position, for sendfile
        try:
            used = copy_spans(spans, fd, self._data_start + offset, method)
        finally:
            os.close(fd)
        self._pending.discard(name)
        return used

    def close(self) -> None:
        if self._pending:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")
        self._file.close()
