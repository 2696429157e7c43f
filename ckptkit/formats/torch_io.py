"""Streaming access to torch pickles (Meta's ``consolidated.NN.pth``, HF's ``.bin``).

Names, shapes and dtypes come from :mod:`ckptkit.formats.pickle_index` (no torch needed,
nothing in the file runs). Tensors are read with ``torch.load(weights_only=True,
mmap=True)`` on first use: data stays on disk until a tensor is read, and the pages of a
tensor that has been read are handed back to the kernel, so resident memory does not grow
with the file. Writing lives in :mod:`ckptkit.formats.torch_writer` (its names are
re-exported here).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import pickle
import re
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.pickle_index import (
    ForbiddenGlobal,
    StoredRecord,
    TensorMeta,
    UnsupportedPickle,
    aliases,
    read_index,
)
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.torch_writer import TorchPickleWriter, save_torch
from ckptkit.io import (
    RecordCheck,
    Span,
    Verifier,
    crc32,
    is_local,
    open_source,
    read_at,
    read_file,
)
from ckptkit.tensors.dtypes import ITEMSIZE, dtype_name, tensor_bytes, to_torch
from ckptkit.untrusted import check_regular

if TYPE_CHECKING:
    import torch

__all__ = ["COPY_CHUNK", "TorchPickleReader", "TorchPickleWriter", "crc32_of", "release_pages", "save_torch"]

_PAGE = mmap.PAGESIZE
_madvise: Any
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # not a POSIX libc: release is skipped
    _madvise = None
_MADV_DONTNEED = 4
COPY_CHUNK = 16 << 20


def release_pages(tensor: torch.Tensor) -> None:
    """Give the resident pages of an mmap-backed tensor back to the kernel."""
    if _madvise is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    start -= start % _PAGE
    end += -end % _PAGE
    _madvise(start, end - start, _MADV_DONTNEED)


def _load(path: Path) -> tuple[object, bool]:
    """``torch.load`` with weights_only=True, mmap when the file allows it (a local file;
    one elsewhere is read whole into memory).

    Returns the loaded object and whether its tensors are backed by the mapped file.
    """
    import torch

    if not is_local(path):
        data = read_file(path)
    else:
        check_regular(path)  # torch.load would block on a FIFO and read a device forever
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not is_local(path):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), False
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
            except RuntimeError as e:
                if "_use_new_zipfile_serialization" not in str(e):
                    raise
                # A legacy (pre-zip) pickle cannot be mapped: read it whole.
                return torch.load(path, map_location="cpu", weights_only=True), False
    except pickle.UnpicklingError as e:
        text = str(e)
        # Garbage bytes fail on an opcode ("Unsupported operand"); a real pickle that wants
        # code (a GLOBAL import, a reduce call) is refused by the weights-only unpickler.
        if "Weights only load failed" not in text or "Unsupported operand" in text:
            raise CkptkitError(f"{path}: not a torch checkpoint (corrupt or not a pickle)") from None
        m = re.search(r"GLOBAL ([\w.]+)", text)
        why = f" (it imports {m.group(1)})" if m else ""
        raise CkptkitError(
            f"{path}: refusing to load: the pickle needs more than weights_only=True allows{why}"
        ) from None
    except (KeyError, EOFError, IndexError, AssertionError, TypeError, struct.error):
        # what torch.load raises on truncated or scrambled pickles
        raise CkptkitError(f"{path}: not a torch checkpoint (corrupt or not a pickle)") from None
    except Exception as e:  # RuntimeError, OSError, ValueError, BadZipFile, ...: damaged archive
        lines = str(e).strip().splitlines()
        first = re.split(r"(?<=[.!?])\s", lines[0])[0] if lines else type(e).__name__
        msg = first if len(first) <= 160 else first[:157] + "..."
        raise CkptkitError(f"{path}: not a readable torch checkpoint ({msg})") from None


class TorchPickleReader:
    """Lazy reader of one ``torch.save`` file holding a flat dict of tensors."""

    def __init__(self, path: Path):
        self.path = path
        self._tensors: dict[str, torch.Tensor] | None = None
        self._mapped = False
        self._index: dict[str, TensorMeta] = {}
        self._stored: dict[str, StoredRecord] = {}  # plain data/<key> records by key
        self.aliases: dict[str, str] = {}  # tensor stored as another one of this file -> that one
        self.metadata: dict[str, str] | None = None  # a pickle has no safetensors __metadata__
        self._verifier = Verifier(path, self._corrupt)  # storage records' CRC-32s, each checked once
        try:
            index, records = read_index(path)
        except ForbiddenGlobal as e:
            raise CkptkitError(
                f"{path}: refusing to load: the pickle needs more than weights_only=True allows (it imports {e})"
            ) from None
        except UnsupportedPickle:  # an older or unusual pickle: let torch.load (weights_only) read it
            self._load_tensors()
            return
        self._index = index
        self._stored = {k: r for k, r in records.items() if "/" not in k}
        self.infos = {k: TensorInfo(k, m.shape, m.dtype, path.name) for k, m in index.items()}
        self.aliases = aliases(index)

    def _load_tensors(self) -> dict[str, torch.Tensor]:
        import torch

        if self._tensors is None:
            obj, self._mapped = _load(self.path)
            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise CkptkitError(f"{self.path}: expected a flat dict of tensors (a state dict)")
            infos = {k: TensorInfo(k, tuple(v.shape), dtype_name(v.dtype), self.path.name) for k, v in obj.items()}
            if not hasattr(self, "infos"):  # no index was readable: find the aliases here
                self.aliases = _shared(obj)
            elif infos != self.infos:
                raise CkptkitError(f"{self.path}: the pickle's tensors differ from its index (corrupt file)")
            self.infos, self._tensors = infos, obj
        return self._tensors

    def read(self, name: str) -> torch.Tensor:
        """One tensor, copied out of the file, its storage's CRC-32 checked."""
        out = self._copy(name)
        self._check_crc(name, out)
        return out

    def _copy(self, name: str) -> torch.Tensor:
        import torch

        if name in self._index and not is_local(self.path):  # not on this disk: no mapping
            return self._read_stored(name)
        src = self._load_tensors()[name]
        if not self._mapped or not src.is_contiguous():
            out = src.clone(memory_format=torch.contiguous_format)
            if self._mapped:
                release_pages(src)
            return out
        # Copy in chunks, handing each chunk's pages back at once: one copy stays resident.
        out = torch.empty(src.shape, dtype=src.dtype)
        src_bytes, out_bytes = src.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        for start in range(0, src_bytes.numel(), COPY_CHUNK):
            chunk = src_bytes[start : start + COPY_CHUNK]
            out_bytes[start : start + COPY_CHUNK].copy_(chunk)
            release_pages(chunk)
        return out

    def _read_stored(self, name: str) -> torch.Tensor:
        """A tensor read from its storage record as the index places it (stride included)."""
        import torch

        meta, info = self._index[name], self.infos[name]
        dtype = to_torch(meta.dtype)
        if info.nbytes == 0:
            return torch.empty(meta.shape, dtype=dtype)
        span = self.span(name)
        if span is not None:  # row-major in one range: read just its bytes
            return torch.frombuffer(self._read(span.offset, span.nbytes), dtype=dtype).reshape(meta.shape)
        data_offset, size, _ = self._stored[meta.storage]
        storage = torch.frombuffer(self._read(data_offset, size), dtype=dtype)
        stride = meta.stride if meta.stride is not None else _row_major_stride(meta.shape)
        return storage.as_strided(meta.shape, stride, meta.offset).contiguous()

    def _read(self, offset: int, nbytes: int) -> bytearray:
        src = open_source(self.path)
        try:
            return read_at(src, offset, nbytes)
        except EOFError:
            raise CkptkitError(f"{self.path}: unexpected end of file (truncated while reading)") from None
        finally:
            src.close()

    def _check_crc(self, name: str, tensor: torch.Tensor) -> None:
        """Compare the CRC-32 of the tensor's storage record with the zip directory's."""
        meta = self._index.get(name)
        if meta is None or self._verifier.verified(meta.storage):
            return  # a legacy (non-zip) pickle has no checksums; a shared storage is checked once
        check = self._record_check(meta.storage)
        if meta.offset == 0 and meta.end == meta.storage_numel and tensor.is_contiguous():
            self._verifier.settle(check, crc32_of(tensor))  # the tensor is its whole storage
        else:
            self._verifier.verify(check)

    def _record_check(self, key: str) -> RecordCheck:
        if key not in self._stored:  # e.g. a key with "/" in it: nothing torch writes
            raise CkptkitError(f"{self.path}: storage {key!r} is not a plain stored record data/<key>; corrupt file")
        data_offset, size, crc = self._stored[key]
        return RecordCheck(self._verifier, key, data_offset, size, crc)

    def _corrupt(self, key: str) -> CkptkitError:
        return CkptkitError(f"{self.path}: record data/{key} fails its CRC-32 check: the file is corrupt")

    def sample(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of a tensor's data."""
        import torch

        whole = self._copy(name) if name in self._index and not is_local(self.path) else self._load_tensors()[name]
        flat = whole.reshape(-1).view(torch.uint8)
        return flat[:nbytes].numpy().tobytes()

    def span(self, name: str) -> Span | None:
        """Where a tensor's bytes lie in the archive, or None when they are not one stored range."""
        meta = self._index.get(name)
        if meta is None or not meta.storage or not _dense(meta.shape, meta.stride):
            return None
        record = self._stored.get(meta.storage)
        nbytes = self.infos[name].nbytes
        start = meta.offset * ITEMSIZE[meta.dtype]
        if record is None or meta.offset < 0 or start + nbytes > record[1]:
            return None
        data_offset, size, crc = record
        whole = crc if start == 0 and nbytes == size else None
        # the record's CRC-32 is checked before (or while) these bytes are copied or read
        return Span(self.path, data_offset + start, nbytes, whole, self._record_check(meta.storage))

    def close(self) -> None:
        self._tensors = None


def _row_major_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _dense(shape: tuple[int, ...], stride: tuple[int, ...] | None) -> bool:
    """Whether a tensor with this shape and stride is row-major contiguous."""
    if stride is None or len(stride) != len(shape):
        return False
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _shared(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Aliases among loaded tensors: same storage, offset, shape, stride and dtype."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def crc32_of(tensor: torch.Tensor) -> int:
    """The CRC-32 of a tensor's bytes (row-major)."""
    return crc32(tensor_bytes(tensor))
