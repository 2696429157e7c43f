"""The skeleton of a ``torch.save`` archive of a flat dict of tensors, written without torch.

:func:`write_skeleton` writes what ``torch.save`` writes under
``torch.serialization.skip_data()``: the pickle (``data.pkl``, opcode for opcode what
torch's pickler emits for a plain dict of contiguous CPU tensors), the small records, and
the zip structure as torch's writer (miniz) lays it out: 64-byte aligned data padded with
an ``FB`` extra field, data descriptors, zip64 fields where offsets or sizes pass 4 GiB,
a zip64 end record. Tensor data is left as a hole for the caller to fill, and tensor
records' CRC-32 as 0 for the caller to patch. Tests compare the result with torch's byte
for byte, all but the 40-digit serialization id (derived from the layout here, from record
names and CRCs in torch: both deterministic). It saves a conversion torch's import (about
a second of CPU and 200 MB) when nothing else needs torch.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ckptkit.formats.pickle_index import STORAGES
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import crc32

STORAGE_OF = {dtype: storage for storage, dtype in STORAGES.items()}
ALIGNMENT = 64
U32 = 0xFFFFFFFF
UTF8, FLAGS = 0x0800, 0x0808  # general purpose flags: UTF-8 names; + sizes in a data descriptor
_BATCH = 1000  # the pickler's SETITEMS batch


@dataclass
class Record:
    name: str  # within the archive, e.g. "data/0"
    header_offset: int
    data_offset: int
    size: int
    crc: int
    central_offset: int = 0


def supported(dtypes: list[str]) -> bool:
    """Whether every dtype has a legacy storage type this writer can name."""
    return all(d in STORAGE_OF for d in dtypes)


class _Pickle:
    """The opcodes torch's pickler (protocol 2) writes for ``{name: tensor}``."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[str, int] = {}  # objects the pickler sees more than once, by role
        self._next = 0  # the next memo index

    def put(self) -> None:
        n = self._next
        self._next += 1
        self.out += b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)

    def shared(self, role: str, emit: bytes) -> None:
        """An object that is the same Python object every time (a global, an interned string)."""
        if role in self.memo:
            n = self.memo[role]
            self.out += b"h" + bytes([n]) if n < 256 else b"j" + struct.pack("<I", n)
        else:
            self.out += emit
            self.memo[role] = self._next
            self.put()

    def string(self, s: str) -> None:
        data = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data
        self.put()

    def integer(self, x: int) -> None:
        if 0 <= x < 0x100:
            self.out += b"K" + bytes([x])
        elif 0 <= x < 0x10000:
            self.out += b"M" + struct.pack("<H", x)
        elif -(2**31) <= x < 2**31:
            self.out += b"J" + struct.pack("<i", x)
        else:
            data = pickle.encode_long(x)
            self.out += b"\x8a" + bytes([len(data)]) + data

    def int_tuple(self, values: tuple[int, ...]) -> None:
        if not values:
            self.out += b")"
            return
        if len(values) > 3:
            self.out += b"("
        for v in values:
            self.integer(v)
        self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(values), b"t")
        self.put()

    def tensor(self, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        untyped = dtype not in STORAGE_OF  # float8: an untyped storage, the dtype after the arguments
        if untyped:
            self.shared("rebuild_v3", b"ctorch._utils\n_rebuild_tensor_v3\n")
        else:
            self.shared("rebuild", b"ctorch._utils\n_rebuild_tensor_v2\n")
        self.out += b"(("  # the argument tuple, then the persistent id tuple
        self.shared("storage", b"X\x07\x00\x00\x00storage")
        if untyped:
            self.shared("UntypedStorage", b"ctorch.storage\nUntypedStorage\n")
        else:
            storage = STORAGE_OF[dtype]
            self.shared(storage, f"ctorch\n{storage}\n".encode())
        self.string(key)
        self.shared("cpu", b"X\x03\x00\x00\x00cpu")
        numel = 1
        for s in shape:
            numel *= s
        self.integer(numel)
        self.out += b"t"
        self.put()
        self.out += b"Q"  # BINPERSID
        self.integer(0)  # storage offset
        self.int_tuple(shape)
        strides, step = [], 1
        for s in reversed(shape):
            strides.append(step)
            step *= s
        self.int_tuple(tuple(reversed(strides)))
        self.out += b"\x89"  # requires_grad False
        self.shared("OrderedDict", b"ccollections\nOrderedDict\n")
        self.out += b")R"
        self.put()
        if untyped:
            self.shared(dtype, f"ctorch\n{dtype}\n".encode())
        self.out += b"t"
        self.put()
        self.out += b"R"
        self.put()


def pickle_state_dict(entries: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """``data.pkl`` for a dict of tensors ``(name, dtype name, shape)``, storages keyed 0, 1, ..."""
    p = _Pickle()
    p.out += b"}"
    p.put()
    if len(entries) == 1:
        name, dtype, shape = entries[0]
        p.string(name)
        p.tensor("0", dtype, shape)
        p.out += b"s"
    elif entries:
        i = 0
        while True:
            batch = entries[i : i + _BATCH]
            p.out += b"("
            for j, (name, dtype, shape) in enumerate(batch, start=i):
                p.string(name)
                p.tensor(str(j), dtype, shape)
            p.out += b"u"
            i += len(batch)
            if len(batch) < _BATCH:
                break
    p.out += b"."
    return bytes(p.out)


def pickle_tensor(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save(tensor)`` for one contiguous tensor, storage key ``0``."""
    p = _Pickle()
    p.tensor("0", dtype, shape)
    p.out += b"."
    return bytes(p.out)


def write_skeleton(
    path: Path, entries: list[tuple[str, str, tuple[int, ...]]], facts: dict[str, str] | None = None
) -> list[Record]:
    """Write the archive for ``entries`` (name, dtype name, shape) with holes for the tensor
    data; returns every record with its offsets (tensor records are ``data/<i>``).
    ``facts``: the archive folder name and serialization id of the file this one restores
    (:func:`ckptkit.formats.pickle_index.archive_facts`); by default torch's folder name (the
    file's base name) and an id derived from the layout."""
    facts = facts or {}
    archive = facts.get("archive") or os.path.splitext(os.path.basename(path))[0]
    sizes = [TensorInfo(n, tuple(s), d).nbytes for n, d, s in entries]
    with path.open("wb") as f:
        return write_archive(f, archive, pickle_state_dict(entries), sizes, facts.get("serialization_id"))


def write_archive(
    f: BinaryIO, archive: str, data_pkl: bytes, sizes: list[int], serialization_id: str | None = None
) -> list[Record]:
    """Write an archive (folder ``archive``) holding ``data_pkl`` and storage records
    ``data/0`` ... of ``sizes`` bytes (holes) at ``f``'s position 0; offsets are ``f``'s.
    ``serialization_id``: the one to record (default: derived from the layout)."""
    contents: list[tuple[str, bytes | int]] = [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
        *[(f"data/{i}", size) for i, size in enumerate(sizes)],
        ("version", b"3\n"),
    ]
    ident = serialization_id.encode() if serialization_id else _serialization_id(contents)
    contents.append((".data/serialization_id", ident))
    records: list[Record] = []
    for name, content in contents:
        records.append(_local_record(f, archive, name, content))
    central_start = f.tell()
    for r in records:
        r.central_offset = f.tell()
        f.write(_central_entry(f"{archive}/{r.name}".encode(), r))
    end = f.tell()
    n, cd_size = len(records), end - central_start
    f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, central_start))
    f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
    short = min(n, 0xFFFF)
    f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, short, short, min(cd_size, U32), min(central_start, U32), 0))
    return records


def _local_record(f: BinaryIO, archive: str, name: str, content: bytes | int) -> Record:
    """A local header of ``archive/name``, the data (a hole when ``content`` is a size) and its data descriptor."""
    pos = f.tell()
    full = f"{archive}/{name}".encode()
    data = content if isinstance(content, bytes) else None
    size = len(data) if data is not None else int(content)
    crc = crc32(data) if data is not None else 0
    big = size >= U32 or pos >= U32
    zip64 = b""
    if big:  # miniz's local zip64 field: the size (compressed size 0), the header's offset
        fields = (struct.pack("<QQ", size, 0) if size >= U32 else b"") + (struct.pack("<Q", pos) if pos >= U32 else b"")
        zip64 = struct.pack("<HH", 1, len(fields)) + fields
    pad = -(pos + 30 + len(full) + len(zip64) + 4) % ALIGNMENT
    extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    flags = FLAGS if size else UTF8  # an empty record has no data descriptor
    f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
    data_offset = f.tell()
    if data is not None:
        f.write(data)
    else:
        f.seek(size, os.SEEK_CUR)
    if size:
        sizes = struct.pack("<QQ", size, size) if big else struct.pack("<II", size, size)
        f.write(struct.pack("<II", 0x08074B50, crc) + sizes)
    return Record(name, pos, data_offset, size, crc)


def _central_entry(full: bytes, r: Record) -> bytes:
    fields = (struct.pack("<QQ", r.size, r.size) if r.size >= U32 else b"") + (
        struct.pack("<Q", r.header_offset) if r.header_offset >= U32 else b""
    )
    extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
    size = min(r.size, U32)
    head = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        *(0x02014B50, 0, 0, FLAGS if r.size else UTF8, 0, 0, 0, r.crc, size, size, len(full), len(extra)),
        *(0, 0, 0, 0, min(r.header_offset, U32)),
    )
    return head + full + extra


def _serialization_id(contents: list[tuple[str, bytes | int]]) -> bytes:
    """40 decimal digits that identify the archive, derived from its records as torch's are
    (torch hashes record names and CRCs; the digits differ, the determinism is the same:
    the same layout gives the same id)."""
    digest = hashlib.sha256()
    for name, content in contents:
        digest.update(name.encode() + b"\0" + (content if isinstance(content, bytes) else str(content).encode()))
    raw = digest.digest()
    return b"%020d%020d" % (int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little"))
