"""PyTorch Distributed Checkpoints (DCP): a folder with ``.metadata`` and ``__R_N.distcp``
files, as ``torch.distributed.checkpoint.save`` writes them from one process or N ranks
(FSDP2, torchtitan).

Reading: ``.metadata`` is a pickle; it is read by a restricted unpickler that resolves only
the classes torch writes there, each to a harmless stand-in of this module, so nothing in
the file runs (:func:`read_metadata`). It gives every tensor's dtype, full shape and chunks
(offsets, sizes), and where each chunk lies: (file, offset, length). Each chunk is its own
``torch.save`` zip, whose members :mod:`ckptkit.formats.pickle_index` checks and scans
without torch; a tensor's bytes are then the chunks' data records, stitched in row-major
order as byte ranges (:class:`~ckptkit.io.Span`), so a conversion copies them file to
file with no tensor in memory, or reads one tensor at a time. Model keys are taken at the
top level or under ``model.``; optimizer, scheduler and train state beside them are listed
(``inspect``) and left alone. torchtitan keeps Meta's names and Q/K layout; its 2026
spelling (``attention.qkv_linear.wq`` ..., ``lm_head``) is read as the same tensors. A
folder of ``step-N`` checkpoints opens the newest complete one. The model config is
``params.json`` or ``config.json`` in the folder (or beside the ``step-N`` folders), or
given with ``--config``.

Writing: Meta-named tensors (torchtitan's), each chunk a ``torch.save`` archive laid out
without torch (:func:`ckptkit.formats.torch_zip.write_archive`) and filled in place,
``--shards N`` files split on dim 0 as N FSDP ranks save them, ``.metadata`` pickled from
torch's own classes, ``params.json`` beside them. ``torch.distributed.checkpoint.load``
reads it in one process without a process group.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import (
    FilePlan,
    OpenedCheckpoint,
    Options,
    Plan,
    RawCheckpoint,
    TensorReader,
    natural_key,
    read_json,
)
from ckptkit.formats.format import CheckpointFormat
from ckptkit.formats.pickle_index import (
    ForbiddenGlobal,
    TensorMeta,
    UnsupportedPickle,
    check_members,
    scan_tensor,
)
from ckptkit.formats.registry import register
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.torch_zip import STORAGE_OF, pickle_tensor, write_archive
from ckptkit.io import AUTO, OutputFile, RecordCheck, Span, Verifier, coalesce, read_spans, take, total_bytes
from ckptkit.models.fields import check_config_fields
from ckptkit.tensors.dtypes import ITEMSIZE, tensor_bytes, to_torch
from ckptkit.untrusted import open_regular

if TYPE_CHECKING:
    import torch

    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.lazy import Lazy

METADATA = ".metadata"
DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
STEP = re.compile(r"step-(\d+)")
PARAMS, HF_CONFIG = "params.json", "config.json"
MAX_METADATA = 1 << 30  # a 405B model's .metadata is a few MB
MODEL_PREFIX = "model."
# First components of the state torchtitan and FSDP2 trainers save beside the model.
STATE_PREFIXES = ("optimizer", "optim", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state")
ARCHIVE = "archive"  # the folder name torch.save gives an archive written to a stream
TIE_SAMPLE_BYTES = 4096


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def meta_name(name: str) -> str:
    """torchtitan's 2026 spelling -> Meta's (the earlier spelling is Meta's already)."""
    if name == "lm_head.weight":
        return "output.weight"
    return re.sub(r"\.attention\.qkv_linear\.(w[qkv])\.", r".attention.\1.", name)


# --- .metadata, read without running code -------------------------------------------------


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
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_METADATA:
            raise CkptkitError(f"{path}: larger than {MAX_METADATA >> 20} MiB; not a DCP .metadata file")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
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


# --- reading chunks -----------------------------------------------------------------------


class _Window(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of an open file, as a seekable file of their own."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self._fd, self._base, self._len, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._len}[whence] + pos
        if self._pos < 0:
            raise ValueError("negative seek position")
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        data = os.pread(self._fd, n, self._base + self._pos) if n else b""
        memoryview(b).cast("B")[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass
class _Stored:
    """A chunk as stored: its bytes as one span (None: not row-major in one record)."""

    span: Span | None


@dataclass
class DcpCheckpoint(RawCheckpoint):
    """A DCP folder's model tensors (by Meta name), stitched from their chunks on read."""

    entries: dict[str, Entry] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    config_kind: str = PARAMS
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
        fd = open_regular(path)
        try:
            window = _Window(fd, chunk.offset, chunk.length)
            try:
                with zipfile.ZipFile(window) as z:
                    if any(zi.header_offset < 0 for zi in z.infolist()):  # an archive that starts before the chunk
                        raise ValueError("member before the start")
                    prefix, members, offsets = check_members(path, z, window, chunk.length)  # type: ignore[arg-type]
                    data = z.read(members[f"{prefix}/data.pkl"])
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error):
                raise self._bad(entry, chunk, "is not a torch.save archive (truncated file or wrong offsets)") from None
        finally:
            os.close(fd)
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

        fd = open_regular(self.root / chunk.file)
        try:
            data = os.pread(fd, chunk.length, chunk.offset)
        finally:
            os.close(fd)
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


class _FileInfos:
    """The tensors (chunks) one ``.distcp`` file holds, for ``inspect``."""

    def __init__(self, infos: dict[str, TensorInfo]) -> None:
        self.infos = infos

    def close(self) -> None:
        pass


# --- the folder ----------------------------------------------------------------------------


def checkpoint_folder(root: Path) -> Path | None:
    """The DCP folder of ``root``: itself, or its newest ``step-N`` folder with a ``.metadata``."""
    if (root / METADATA).is_file():
        return root
    try:
        steps = [p for p in root.iterdir() if STEP.fullmatch(p.name) and (p / METADATA).is_file()]
    except OSError:
        return None
    if not steps:
        return None
    return max(steps, key=lambda p: int(STEP.fullmatch(p.name).group(1)))  # type: ignore[union-attr]


def _config_kind(path: Path, doc: dict[str, Any]) -> str:
    if "n_layers" in doc or "dim" in doc:
        return PARAMS
    if "model_type" in doc or "num_hidden_layers" in doc:
        return HF_CONFIG
    raise CkptkitError(f"{path}: neither a params.json (dim, n_layers) nor a config.json (model_type)")


def find_config(folder: Path, root: Path, given: Path | None) -> Path:
    if given is not None:
        if not given.is_file():
            raise CkptkitError(f"{given}: --config: no such file")
        return given
    for where in dict.fromkeys((folder, root)):
        for name in (PARAMS, HF_CONFIG):
            if (where / name).is_file():
                return where / name
    raise CkptkitError(
        f"{folder}: a DCP folder without a model config (params.json or config.json) names no model type or dims; "
        "pass --config params.json|config.json"
    )


def open_dcp(root: Path, config: Path | None) -> DcpCheckpoint:
    folder = checkpoint_folder(root)
    if folder is None:
        raise CkptkitError(f"{root}: not a DCP checkpoint (no .metadata, nor step-N folders holding one)")
    md = read_metadata(folder / METADATA)
    config_path = find_config(folder, root, config)
    text, doc = read_json(config_path)
    kind = _config_kind(config_path, doc)
    check_config_fields(kind, doc, config_path)
    prefixed = any(k.startswith(MODEL_PREFIX) for k in md.tensors)
    entries: dict[str, Entry] = {}
    ignored = list(md.others)
    sizes: dict[str, int] = {}
    for fqn, entry in md.tensors.items():
        if prefixed and not fqn.startswith(MODEL_PREFIX) or fqn.split(".", 1)[0] in STATE_PREFIXES:
            ignored.append(fqn)
            continue
        name = meta_name(fqn.removeprefix(MODEL_PREFIX) if prefixed else fqn)
        if name in entries:
            raise CkptkitError(f"{folder / METADATA}: {fqn!r} and {entries[name].fqn!r} are the same tensor")
        if entry.dtype not in STORAGE_OF:
            raise CkptkitError(f"{folder / METADATA}: {fqn!r} has dtype {entry.dtype}, which ckptkit cannot read")
        check_tiling(entry, folder / METADATA)
        for c in entry.chunks:
            if not DISTCP.fullmatch(c.file):
                raise CkptkitError(f"{folder / METADATA}: invalid storage file name {c.file!r} (expected __R_N.distcp)")
            if c.file not in sizes:
                try:
                    sizes[c.file] = os.stat(folder / c.file).st_size
                except OSError:
                    raise CkptkitError(f"{folder / c.file}: missing (.metadata places {fqn!r} there)") from None
            if c.offset < 0 or c.length <= 0 or c.offset + c.length > sizes[c.file]:
                where = f"bytes {c.offset}..{c.offset + c.length} of a {sizes[c.file]}-byte file"
                why = f".metadata places a chunk of {fqn!r} at {where} (truncated file or wrong offsets)"
                raise CkptkitError(f"{folder / c.file}: {why}")
        entries[name] = entry
    if not entries:
        raise CkptkitError(f"{folder / METADATA}: holds no model tensors")
    per_file: dict[str, dict[str, TensorInfo]] = {}
    for name, entry in entries.items():
        for c in entry.chunks:
            infos = per_file.setdefault(c.file, {})
            if name in infos:  # two chunks of one tensor in one file: list them as one
                infos[name] = TensorInfo(name, (infos[name].numel + c.numel,), entry.dtype, c.file)
            else:
                infos[name] = TensorInfo(name, c.sizes, entry.dtype, c.file)
    files = sorted(per_file, key=natural_key)
    readers: dict[str, TensorReader] = {f: _FileInfos(per_file[f]) for f in files}  # type: ignore[misc]
    return DcpCheckpoint(
        format="dcp",
        root=folder,
        files={f: list(per_file[f]) for f in files},
        infos={n: TensorInfo(n, e.shape, e.dtype, e.chunks[0].file) for n, e in entries.items()},
        readers=readers,
        config_name=str(config_path.relative_to(folder)) if config_path.parent == folder else str(config_path),
        config_text=text,
        config=doc,
        entries=entries,
        ignored=ignored,
        config_kind=kind,
    )


# --- writing -------------------------------------------------------------------------------


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


def _entries(plan: Plan, file: FilePlan) -> list[tuple[str, str, tuple[int, ...]]]:
    from ckptkit.tensors.transforms import RANKS

    return [
        (k, plan.targets[k].dtype, tuple(RANKS.shard_shape(plan.targets[k].shape, file.ranks, plan.split_dims.get(k))))
        for k in file.keys
    ]


class DistcpWriter:
    """One ``__R_0.distcp`` file: a ``torch.save`` archive per tensor, filled in place."""

    def __init__(self, path: Path, entries: list[tuple[str, Any, tuple[int, ...]]], direct: bool = False) -> None:
        from ckptkit.tensors.dtypes import dtype_name

        named = [(n, dtype_name(d), tuple(s)) for n, d, s in entries]
        odd = [d for _, d, _ in named if d not in STORAGE_OF]
        if odd:
            raise CkptkitError(f"{path.name}: dtype {odd[0]} cannot be written to a DCP checkpoint")
        self.path = path
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        self._out = OutputFile(path, direct)
        self.places = lay_out(self._out, named)
        self._crcs: dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_bytes(name, tensor_bytes(tensor))

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        place = self.places[name]
        if memoryview(data).nbytes != place.nbytes:
            raise ValueError(f"{name}: {memoryview(data).nbytes} bytes for a {place.nbytes}-byte chunk")
        self._out.write(data, place.data_offset)
        self._crcs[name] = zlib.crc32(data)

    def write_spans(self, name: str, spans: list[Span], method: str = AUTO) -> str:
        place = self.places[name]
        if total_bytes(spans) != place.nbytes:
            raise ValueError(f"{name}: spans of {total_bytes(spans)} bytes for a {place.nbytes}-byte chunk")
        done = self._out.copy(spans, place.data_offset, method, want_crc=True)
        assert done.crc is not None
        self._crcs[name] = done.crc
        return done.method

    def close(self) -> None:
        try:
            missing = [n for n in self.places if n not in self._crcs]
            if missing:
                raise RuntimeError(f"{self.path}: tensors never written: {missing[:5]}")
            for name, crc in self._crcs.items():
                raw = crc.to_bytes(4, "little")
                self._out.write(raw, self.places[name].header_offset + 14, writeback=False)
                self._out.write(raw, self.places[name].central_offset + 16, writeback=False)
        finally:
            self.discard()

    def discard(self) -> None:
        self._out.close()


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
        entries = _entries(plan, f)
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


class DcpFormat(CheckpointFormat):
    """``.metadata`` + ``__R_N.distcp`` (``step-N`` folders allowed), torchtitan's Meta names."""

    name = "dcp"
    expects = ".metadata + __R_N.distcp (PyTorch DCP)"
    detect_order = 15
    sharding = "ranks"
    weight_file = DISTCP
    metadata_names = (METADATA,)
    layer_field = "n_layers"

    def detect(self, root: Path) -> bool:
        return checkpoint_folder(root) is not None

    def open(self, root: Path) -> RawCheckpoint:
        return open_dcp(root, None)

    def open_with_config(self, root: Path, config: Path | None) -> RawCheckpoint:
        return open_dcp(root, config)

    def _source(self, raw: RawCheckpoint) -> Any:
        from ckptkit.models import MetaSource

        return MetaSource(
            raw.config, {k: i.shape for k, i in raw.infos.items()}, "pth", lambda: _output_repeats_embeddings(raw)
        )

    def family(self, raw: RawCheckpoint) -> Family:
        from ckptkit.models import detect_from_hf, detect_from_meta

        where = str(raw.root / raw.config_name)
        if getattr(raw, "config_kind", PARAMS) == HF_CONFIG:
            return detect_from_hf(raw.config, where)
        return detect_from_meta(self._source(raw), where)

    def read_config(self, raw: RawCheckpoint, family: Family) -> ModelConfig:
        try:
            if getattr(raw, "config_kind", PARAMS) == HF_CONFIG:
                return family.config_from_hf(raw.config)
            return family.config_from_meta(self._source(raw))
        except CkptkitError as e:
            raise CkptkitError(f"{raw.root / raw.config_name}: {e}") from None

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        return family.meta_layout(cfg)

    def own_layout(self, ckpt: OpenedCheckpoint) -> dict[str, Any]:
        return {}  # a DCP layout (ranks, chunks) is not restored: converting to dcp lays out afresh

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        if opts.max_shard_size is not None:
            raise CkptkitError("--max-shard-size applies to HF formats; use --shards N for DCP ranks")
        n = opts.shards or 1
        split: dict[str, int | None] = {}
        for k, t in targets.items():
            split[k] = 0 if n > 1 and t.shape and t.shape[0] % n == 0 and t.shape[0] >= n else None
        files = [
            FilePlan(rank_file(r), [k for k in targets if r == 0 or split[k] is not None], rank=r, ranks=n)
            for r in range(n)
        ]
        return files, split if n > 1 else {}

    def writer(self, path: Path, file: FilePlan, entries: Any, direct: bool) -> Any:
        return DistcpWriter(path, entries, direct)

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        return {PARAMS: json.dumps(ckpt.family.config_to_meta(ckpt.config)) + "\n"}

    def finish(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        (out_dir / METADATA).write_bytes(metadata_bytes(plan))
        super().finish(ckpt, plan, out_dir)


def _output_repeats_embeddings(raw: RawCheckpoint) -> bool:
    emb, out = raw.infos.get("tok_embeddings.weight"), raw.infos.get("output.weight")
    if emb is None or out is None or emb.shape != out.shape or emb.dtype != out.dtype:
        return False
    sample = getattr(raw, "sample")  # noqa: B009 (DcpCheckpoint's)
    return bool(sample("tok_embeddings.weight", TIE_SAMPLE_BYTES) == sample("output.weight", TIE_SAMPLE_BYTES))


register(DcpFormat())


__all__ = ["DcpCheckpoint", "DcpFormat", "read_metadata", "stitch"]
