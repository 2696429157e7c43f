"""A DCP folder's ``.metadata``, read without running code.

``.metadata`` is a pickle of torch's ``Metadata``. It is read by a restricted unpickler that
resolves only the classes torch writes there (FORMATS.md lists them), each to a harmless
stand-in of this module, so nothing in the file runs: it gives every tensor's dtype, full
shape and chunks (offsets, sizes), and where each chunk lies (file, offset, length);
anything else is refused with one line. :func:`check_tiling` checks that a tensor's chunks
cover it exactly once.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.pickle_index import ForbiddenGlobal
from ckptkit.io import open_source, read_at
from ckptkit.tensors.dtypes import ITEMSIZE

METADATA = ".metadata"
MAX_METADATA = 1 << 30  # a 405B model's .metadata is a few MB


class _Stub:
    """What the unpickler builds for a class torch writes in ``.metadata``: its arguments
    and pickled state, nothing else; no method of torch's class ever runs."""

    kind = ""

    def __new__(cls, *args: Any) -> _Stub:  # NEWOBJ: cls.__new__(cls, *args)
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE: cls(*args)
        pass

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    args: tuple[Any, ...]
    state: Any

    def fields(self) -> dict[str, Any]:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # (None, slots)
            state = state[1]
        return state if isinstance(state, dict) else {}


def _stub(kind: str) -> type[_Stub]:
    return type(kind, (_Stub,), {"kind": kind})


@dataclass(frozen=True)
class _Dtype:
    name: str


@dataclass(frozen=True)
class _Layout:
    name: str


def _size(values: Any = ()) -> tuple[int, ...]:
    """torch.Size(values): a tuple of non-negative ints, nothing else."""
    if not isinstance(values, (tuple, list)) or not all(type(v) is int and v >= 0 for v in values):
        raise _Malformed("a torch.Size that is not a tuple of sizes")
    return tuple(values)


def _get_layout(name: Any) -> _Layout:
    if name != "torch.strided":
        raise _Malformed(f"tensor layout {name!r} (only torch.strided is written)")
    return _Layout(name)


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise _Malformed("a path that is not made of strings")
    return "/".join(parts)


class _Malformed(Exception):
    """``.metadata`` holds something torch does not write there."""


_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[tuple[str, str], Any] = {
    **{
        (_DCP, n): _stub(n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _stub("_StorageInfo"),
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib._local", "PosixPath"): _path,  # Python 3.13's module of PosixPath
    **{("torch", d): _Dtype(d) for d in ITEMSIZE},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise ForbiddenGlobal(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Malformed("a persistent id")


@dataclass
class Chunk:
    """One stored piece of a tensor: its place in the tensor and where its archive lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = ""
    offset: int = 0
    length: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class Entry:
    """One tensor of ``.metadata``: dtype name, full shape, chunks."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass
class DcpMetadata:
    tensors: dict[str, Entry]
    others: list[str]  # non-tensor entries (pickled objects: train state, RNG, ...)


def read_metadata(path: Path) -> DcpMetadata:
    """``.metadata`` as plain data, read by a restricted unpickler (nothing in it runs);
    a one-line error for anything torch does not write there."""
    src = open_source(path)
    try:
        size = src.size()
        if size > MAX_METADATA:
            raise CkptkitError(f"{path}: larger than {MAX_METADATA >> 20} MiB; not a DCP .metadata file")
        data = read_at(src, 0, size)
    except EOFError:
        raise CkptkitError(f"{path}: changed while it was read (shorter than its size)") from None
    finally:
        src.close()
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
        return _metadata(obj)
    except ForbiddenGlobal as e:
        raise CkptkitError(
            f"{path}: refusing to load: the pickle imports {e}, which torch never writes in a DCP .metadata"
        ) from None
    except _Malformed as e:
        raise CkptkitError(f"{path}: not a DCP .metadata file (it holds {e})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CkptkitError(f"{path}: not a readable DCP .metadata file (corrupt pickle: {type(e).__name__})") from None
    except RecursionError:
        raise CkptkitError(f"{path}: not a readable DCP .metadata file (nested too deeply)") from None


def _is(obj: Any, kind: str) -> bool:
    return isinstance(obj, _Stub) and obj.kind == kind


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Malformed(what)


def _metadata(obj: Any) -> DcpMetadata:
    _need(_is(obj, "Metadata"), "no Metadata object")
    fields = obj.fields()
    sd = fields.get("state_dict_metadata")
    storage = fields.get("storage_data")
    _need(isinstance(sd, dict) and isinstance(storage, dict), "no state_dict_metadata or storage_data")
    places: dict[tuple[str, tuple[int, ...] | None], Chunk] = {}
    for index, info in storage.items():
        _need(_is(index, "MetadataIndex") and _is(info, "_StorageInfo"), "an unexpected storage_data entry")
        i, s = index.fields(), info.fields()
        fqn, offset = i.get("fqn"), i.get("offset")
        rel, start, length = s.get("relative_path"), s.get("offset"), s.get("length")
        _need(isinstance(fqn, str) and (offset is None or isinstance(offset, tuple)), "a malformed MetadataIndex")
        _need(isinstance(rel, str) and type(start) is int and type(length) is int, "a malformed _StorageInfo")
        if s.get("transform_descriptors"):
            raise CkptkitError(
                f"{fqn}: stored with transforms {s['transform_descriptors']!r} (compressed); "
                "ckptkit reads uncompressed DCP checkpoints only"
            )
        places[(fqn, offset)] = Chunk((), (), rel, start, length)
    tensors: dict[str, Entry] = {}
    others: list[str] = []
    for fqn, md in sd.items():
        _need(isinstance(fqn, str), "a state_dict_metadata key that is not a string")
        if _is(md, "BytesStorageMetadata"):
            others.append(fqn)
            continue
        _need(_is(md, "TensorStorageMetadata"), f"an unexpected entry for {fqn!r}")
        f = md.fields()
        props, shape, chunks = f.get("properties"), f.get("size"), f.get("chunks")
        _need(_is(props, "TensorProperties") and isinstance(props.state, tuple) and len(props.state) >= 1, "properties")
        dtype = props.state[0]
        _need(isinstance(dtype, _Dtype), f"no dtype for {fqn!r}")
        _need(isinstance(shape, tuple) and isinstance(chunks, list), f"a malformed entry for {fqn!r}")
        found = []
        for c in chunks:
            _need(_is(c, "ChunkStorageMetadata"), f"a malformed chunk of {fqn!r}")
            cf = c.fields()
            offsets, sizes = cf.get("offsets"), cf.get("sizes")
            _need(isinstance(offsets, tuple) and isinstance(sizes, tuple), f"a malformed chunk of {fqn!r}")
            place = places.get((fqn, offsets))
            if place is None:
                raise _Malformed(f"no storage record for a chunk of {fqn!r} at {list(offsets)}")
            found.append(Chunk(offsets, sizes, place.file, place.offset, place.length))
        tensors[fqn] = Entry(fqn, dtype.name, shape, found)
    return DcpMetadata(tensors, others)


def check_tiling(entry: Entry, where: Path) -> None:
    """The chunks lie inside the tensor, do not overlap and cover it."""
    shape = entry.shape
    chunks = [c for c in entry.chunks if c.numel]
    for c in entry.chunks:
        ok = len(c.offsets) == len(c.sizes) == len(shape) and all(
            o + s <= n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)
        )
        if not ok:
            raise CkptkitError(f"{where}: a chunk of {entry.fqn!r} lies outside its shape {list(shape)}")
    for a, b in itertools.combinations(chunks, 2):
        if all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
            raise CkptkitError(f"{where}: chunks of {entry.fqn!r} overlap")
    if sum(c.numel for c in chunks) != math.prod(shape):
        raise CkptkitError(f"{where}: the chunks of {entry.fqn!r} do not cover its shape {list(shape)}")
