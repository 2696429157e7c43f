"""Tensor names, shapes and dtypes of a ``torch.save`` zip archive, without torch.

``data.pkl`` is scanned opcode by opcode (``pickletools.genops``) with a small stack that
holds only plain values: strings, numbers, tuples, dicts, and markers for the few globals
a state dict needs (the allowlist ``torch.load(weights_only=True)`` also applies). No
global is ever resolved or called, so nothing in the file can run. Anything outside that
subset raises :class:`UnsupportedPickle` and the caller falls back to ``torch.load``
(weights_only). Tensor data is read only through ``torch.load``.
"""

from __future__ import annotations

import io
import math
import os
import pickletools
import re
import struct
import zipfile
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, cast

from ckptkit.errors import CkptkitError
from ckptkit.io import Window, open_source
from ckptkit.tensors.dtypes import ITEMSIZE

STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}  # fmt: skip
REBUILD = {"torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_parameter"}
REBUILD_V3 = "torch._utils _rebuild_tensor_v3"  # dtypes without a typed storage: an untyped one + the dtype
UNTYPED = "torch.storage UntypedStorage"
BYTE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")  # one byte each: storage bytes = elements


class UnsupportedPickle(Exception):
    """The pickle uses something this scanner does not model (torch.load may still read it)."""


class ForbiddenGlobal(Exception):
    """The pickle imports a global that weights_only loading refuses."""


@dataclass(frozen=True)
class Global:
    name: str


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as the pickle describes it: shape, dtype, and where its data lies in its storage
    (the zip record ``data/<storage>``, from element ``offset``, with ``stride``)."""

    shape: tuple[int, ...]
    dtype: str
    storage: str = ""  # the storage record's key (``data/KEY``)
    offset: int = 0  # first element in the storage
    stride: tuple[int, ...] | None = None
    end: int = 0  # one past the last element in the storage (0 for an empty tensor)
    storage_numel: int = 0


_MARK = object()
_PUSH_ARG = {"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8", "BININT", "BININT1", "BININT2", "LONG1",
             "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "SHORT_BINSTRING", "BINSTRING", "STRING"}  # fmt: skip
_PUSH_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


def scan(data: bytes) -> dict[str, TensorMeta]:
    """The tensors of a state-dict pickle, in dict order."""
    top = _run(data)
    if not isinstance(top, dict):
        raise UnsupportedPickle("not a dict")
    out = {}
    for key, value in top.items():
        if not isinstance(key, str) or not isinstance(value, TensorMeta):
            raise UnsupportedPickle("not a flat dict of tensors")
        out[key] = value
    return out


def scan_tensor(data: bytes) -> TensorMeta:
    """The one tensor a ``torch.save(tensor)`` pickle holds (a DCP chunk)."""
    top = _run(data)
    if not isinstance(top, TensorMeta):
        raise UnsupportedPickle("not a tensor")
    return top


def _run(data: bytes) -> object:
    """The object a pickle builds, within the subset modelled here (tensors as TensorMeta)."""
    stack: list[object] = []
    memo: dict[int, object] = {}

    def pop_mark() -> list[object]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise UnsupportedPickle("MARK missing")

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _PUSH_CONST:
            stack.append(_PUSH_CONST[name])
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            n = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(name)
            items = pop_mark() if n is None else [stack.pop() for _ in range(n)][::-1]
            stack.append(tuple(items))
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(cast(Any, arg))] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[int(cast(Any, arg))])
        elif name == "GLOBAL":
            stack.append(_global(str(arg).replace("\n", " ")))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(_global(f"{module} {attr}"))
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], Global)):
                raise UnsupportedPickle("unexpected persistent id")
            kind = pid[1].name
            dtype = (
                "untyped"
                if kind == UNTYPED
                else STORAGES.get(kind.split(" ")[1])
                if kind.startswith("torch ")
                else None
            )
            if dtype is None:
                raise UnsupportedPickle("unexpected storage type")
            stack.append(("storage", dtype, str(pid[2]), int(pid[4])))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            stack.append(_reduce(fn, args))
        elif name in ("SETITEM", "SETITEMS"):
            items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else pop_mark()
            target = stack[-1]
            if not isinstance(target, dict):
                raise UnsupportedPickle("SETITEMS on a non-dict")
            for k, v in zip(items[::2], items[1::2], strict=True):
                target[k] = v
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else pop_mark()
            if not isinstance(stack[-1], list):
                raise UnsupportedPickle("APPENDS on a non-list")
            stack[-1].extend(items)
        elif name == "BUILD":
            stack.pop()  # state of an OrderedDict/tensor: nothing we list
        else:
            raise UnsupportedPickle(f"opcode {name}")
    if len(stack) != 1:
        raise UnsupportedPickle("not one object")
    return stack[0]


def _global(name: str) -> Global:
    module, _, attr = name.partition(" ")
    allowed = (
        name in REBUILD
        or name in (REBUILD_V3, UNTYPED, "collections OrderedDict")
        or (module == "torch" and (attr in STORAGES or attr in BYTE_DTYPES))
    )
    if not allowed:
        raise ForbiddenGlobal(f"{module}.{attr}")
    return Global(name)


def _reduce(fn: object, args: object) -> object:
    if not isinstance(fn, Global) or not isinstance(args, tuple):
        raise UnsupportedPickle("REDUCE on a non-global")
    if fn.name == "collections OrderedDict":
        return {}
    if fn.name == "torch._utils _rebuild_parameter":
        return args[0]
    storage, offset, size = args[0], args[1], args[2]
    if fn.name == REBUILD_V3:  # (storage, offset, size, stride, requires_grad, hooks, dtype)
        dtype = args[6] if len(args) > 6 else None
        if not (isinstance(dtype, Global) and dtype.name.split(" ")[1] in BYTE_DTYPES and storage[1] == "untyped"):
            raise UnsupportedPickle("an untyped storage of a dtype wider than a byte")
        storage = (*storage[:1], dtype.name.split(" ")[1], *storage[2:])
    elif isinstance(storage, tuple) and storage[1] == "untyped":
        raise UnsupportedPickle("an untyped storage without its dtype")
    stride = args[3] if len(args) > 3 else None
    if not (isinstance(storage, tuple) and storage[0] == "storage" and isinstance(size, tuple)):
        raise UnsupportedPickle("unexpected tensor arguments")
    if not isinstance(offset, int) or not (stride is None or isinstance(stride, tuple)):
        raise UnsupportedPickle("unexpected tensor arguments")
    shape = tuple(int(s) for s in size)
    steps = None if stride is None else tuple(int(s) for s in stride)
    if steps is not None and (len(steps) != len(shape) or min((*shape, *steps, 0)) < 0):
        raise UnsupportedPickle("unexpected tensor strides")
    numel = math.prod(shape)
    if not numel:
        end = 0
    elif steps is None:
        end = offset + numel
    else:
        end = offset + 1 + sum((n - 1) * st for n, st in zip(shape, steps, strict=True))
    return TensorMeta(shape, storage[1], storage[2], offset, steps, end, storage[3])


def aliases(index: dict[str, TensorMeta]) -> dict[str, str]:
    """Tensors that are another tensor of the file (same bytes, shape and dtype) -> that tensor."""
    first: dict[TensorMeta, str] = {}
    out = {}
    for name, meta in index.items():
        if meta in first:
            out[name] = first[meta]
        else:
            first[meta] = name
    return out


class StoredRecord(NamedTuple):
    """A stored (uncompressed) zip member: where its data starts, its size, its recorded CRC-32."""

    offset: int
    size: int
    crc: int


def read_index(path: Path) -> tuple[dict[str, TensorMeta], dict[str, StoredRecord]]:
    """The tensors of a zip-format ``torch.save`` file and its checked storage records
    (by key); UnsupportedPickle for a file that is not a zip archive."""
    src = open_source(path)
    with closing(src), io.BufferedReader(Window(src)) as f:
        try:
            z = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise UnsupportedPickle(str(e)) from None
        with z:
            prefix, members, offsets = check_members(path, z, f)
            try:
                data = z.read(members[f"{prefix}/data.pkl"])
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                raise CkptkitError(f"{path}: damaged zip archive ({e})") from None
    try:
        tensors = scan(data)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as e:  # malformed opcode stream
        raise UnsupportedPickle(str(e)) from None
    records = {}
    for name, zi in members.items():
        if name.startswith(f"{prefix}/data/"):
            records[name.removeprefix(f"{prefix}/data/")] = StoredRecord(offsets[name], zi.file_size, zi.CRC)
    check_storages(path, tensors, records)
    return tensors, records


SERIALIZATION_ID = re.compile(r"[0-9]{1,64}")  # torch writes 40 decimal digits
ARCHIVE_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def archive_facts(path: Path) -> dict[str, str] | None:
    """What a ``torch.save`` zip holds besides its tensors and pickle that its layout does
    not determine: the archive's folder name and its ``.data/serialization_id`` (a random
    or hashed id). Recorded so that converting back writes the same bytes; None for a file
    that is not such an archive."""
    try:
        src = open_source(path)
        with closing(src), io.BufferedReader(Window(src)) as f, zipfile.ZipFile(f) as z:
            prefix, members, _ = check_members(path, z, f)
            facts = {"archive": prefix}
            zi = members.get(f"{prefix}/.data/serialization_id")
            if zi is not None and zi.file_size <= 64:
                ident = z.read(zi).decode("ascii", "replace")
                if SERIALIZATION_ID.fullmatch(ident):
                    facts["serialization_id"] = ident
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, CkptkitError):
        return None
    return facts if ARCHIVE_NAME.fullmatch(prefix) else None


# --- zip members: what torch.save writes, nothing else ---------------------------------------

_ENCRYPTED, _UTF8 = 0x1, 0x800


def _plain_member(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) >= 2
        and all(p not in ("", ".", "..") for p in parts)
        and all(c.isprintable() and c != "\\" for c in name)
    )


def check_members(
    path: Path, z: zipfile.ZipFile, f: BinaryIO, size: int | None = None
) -> tuple[str, dict[str, zipfile.ZipInfo], dict[str, int]]:
    """The archive's folder name, members by name and where each member's data starts,
    after checking each member is stored (not compressed), not encrypted, plainly named in
    UTF-8, unique, inside the file, and that its local header agrees with the central
    directory (what torch's reader checks). ``size``: the archive's size, when it is a
    window of a larger file (a DCP chunk); default the file's."""
    if size is None:
        size = f.seek(0, os.SEEK_END)
    members: dict[str, zipfile.ZipInfo] = {}
    offsets: dict[str, int] = {}
    for zi in z.infolist():
        name = zi.filename
        if zi.flag_bits & _ENCRYPTED:
            raise CkptkitError(f"{path}: zip member {name!r} is encrypted; torch checkpoints never are")
        if zi.compress_type != zipfile.ZIP_STORED:
            raise CkptkitError(
                f"{path}: zip member {name!r} is compressed (method {zi.compress_type}); "
                "torch checkpoints store members uncompressed"
            )
        if not (zi.flag_bits & _UTF8 or name.isascii()) or not _plain_member(name):
            raise CkptkitError(f"{path}: zip member name {name!r} is not a plain UTF-8 path")
        if name in members:
            raise CkptkitError(f"{path}: zip member {name!r} appears twice")
        if zi.file_size != zi.compress_size or zi.header_offset + 30 + zi.file_size > z.start_dir or z.start_dir > size:
            raise CkptkitError(f"{path}: zip member {name!r} has sizes or an offset outside the file")
        offsets[name] = _check_local_header(path, f, zi, size)
        members[name] = zi
    prefixes = {n.split("/", 1)[0] for n in members}
    if len(prefixes) != 1 or f"{next(iter(prefixes))}/data.pkl" not in members:
        raise CkptkitError(f"{path}: not a torch checkpoint (expected one folder holding data.pkl in the zip archive)")
    return prefixes.pop(), members, offsets


def _check_local_header(path: Path, f: BinaryIO, zi: zipfile.ZipInfo, size: int) -> int:
    """Where the member's data starts, after checking its local header."""
    raw_name = zi.filename.encode("utf-8" if zi.flag_bits & _UTF8 else "ascii")
    f.seek(zi.header_offset)
    local = f.read(30 + len(raw_name))
    ok = len(local) == 30 + len(raw_name) and local[:4] == b"PK\x03\x04"
    if ok:
        flags, method = struct.unpack("<HH", local[6:10])
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        ok = (
            method == zi.compress_type
            and not flags & _ENCRYPTED
            and name_len == len(raw_name)
            and local[30:] == raw_name
            and zi.header_offset + 30 + name_len + extra_len + zi.file_size <= size
        )
    if not ok:
        raise CkptkitError(f"{path}: zip member {zi.filename!r} has a damaged local header")
    return zi.header_offset + 30 + name_len + extra_len


def check_storages(path: Path, tensors: dict[str, TensorMeta], records: dict[str, StoredRecord]) -> None:
    """Every tensor's storage record exists, has the size the pickle says, and holds the tensor."""
    for name, t in tensors.items():
        record = records.get(t.storage)
        itemsize = ITEMSIZE[t.dtype]
        if record is None or record.size != t.storage_numel * itemsize:
            raise CkptkitError(f"{path}: the storage of tensor {name!r} is missing or has the wrong size")
        if t.offset < 0 or t.end > t.storage_numel:
            raise CkptkitError(f"{path}: tensor {name!r} lies outside its storage")
