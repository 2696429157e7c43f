"""Reading a GGUF file's header, key/value metadata and tensor infos, as untrusted input.

Only the header region is read (a window at a time), never the tensor data: the time to
read it does not depend on the file's size. Every count, length and offset is checked
against the bytes the file holds before anything is allocated for it; unknown value or
tensor types, duplicate keys or names, misaligned, out-of-file or overlapping tensors are
one-line errors naming the file.
"""

from __future__ import annotations

import math
import struct
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.io import Window, open_source

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_HEADER_BYTES = 1 << 30  # key/values and tensor infos; Llama 3's vocabulary takes ~10 MB
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_ITEMS = 1 << 23  # in all arrays together; real vocabularies hold well under a million
MAX_DIMS = 4  # GGML_MAX_DIMS
WINDOW = 1 << 20

# GGUFValueType -> (name, struct format); STRING 8 and ARRAY 9 are read apart
SCALARS: dict[int, tuple[str, str]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"), 4: ("uint32", "<I"),
    5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<B"), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
    12: ("float64", "<d"),
}  # fmt: skip
STRING, ARRAY = 8, 9
# stored type -> torch dtype name, for the types read without dequantizing
PLAIN = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: name, torch-order shape (GGUF's dims reversed), GGML type name, where its
    bytes lie (absolute offset) and how many there are."""

    name: str
    shape: tuple[int, ...]
    kind: str
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # key -> value (lists for arrays), in stored order
    types: dict[str, str]  # key -> value type ("uint32", "array[string]")
    tensors: list[GGUFTensorInfo]  # in stored order
    alignment: int
    data_start: int
    file_size: int
    header_bytes: int = 0  # bytes read to parse it
    warnings: list[str] = field(default_factory=list)

    def error(self, what: str) -> CkptkitError:
        return CkptkitError(f"{self.path}: {what}")


class _Cursor:
    """Sequential reads of the header through a window, each length checked against the file."""

    def __init__(self, f: Any, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.buf = b""
        self.base = 0  # file offset of buf[0]
        self.pos = 0  # file offset of the next byte to parse
        self.read_bytes = 0
        self.items = 0  # array items read so far

    def error(self, what: str) -> CkptkitError:
        return CkptkitError(f"{self.path}: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.error(f"truncated or lying {what}: {n} bytes needed, {self.size - self.pos} left in the file")
        if self.pos + n > MAX_HEADER_BYTES:
            raise self.error(f"header larger than {MAX_HEADER_BYTES >> 20} MiB; not a GGUF ckptkit reads")
        end = self.pos + n
        if end > self.base + len(self.buf):
            keep = self.buf[self.pos - self.base :]
            self.f.seek(self.base + len(self.buf))
            more = self.f.read(max(WINDOW, end - self.base - len(self.buf)))
            self.read_bytes += len(more)
            self.buf, self.base = keep + more, self.pos
            if end > self.base + len(self.buf):
                raise self.error(f"unexpected end of file reading {what}")
        start = self.pos - self.base
        self.pos = end
        return self.buf[start : start + n]

    def scalar(self, kind: int, what: str) -> Any:
        name, fmt = SCALARS[kind]
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        if kind == 6:  # the shortest decimal that is this float32 (1e-05, not 9.99999974e-06)
            return float(f"{value:.9g}") if not math.isfinite(value) else _shortest_f32(value)
        if kind == 7:
            if value not in (0, 1):
                raise self.error(f"{what}: bool value {value}, not 0 or 1")
            return bool(value)
        return value

    def count(self, what: str, least_bytes_each: int) -> int:
        """A uint64 count of items of at least ``least_bytes_each`` bytes: no more than the
        rest of the file can hold."""
        n: int = self.scalar(10, what)
        if n * max(1, least_bytes_each) > self.size - self.pos:
            raise self.error(f"lying {what} {n}: the {self.size - self.pos} bytes left cannot hold them")
        return n

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.scalar(10, f"{what} length")
        if limit is not None and n > limit:
            raise self.error(f"{what} of {n} bytes, more than {limit}")
        data = self.take(n, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8") from None


def _shortest_f32(value: float) -> float:
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", short))[0] == value:
            return short
    return value


def _value(c: _Cursor, kind: int, key: str, depth: int = 0) -> tuple[Any, str]:
    if kind in SCALARS:
        return c.scalar(kind, f"value of {key}"), SCALARS[kind][0]
    if kind == STRING:
        return c.string(f"value of {key}"), "string"
    if kind == ARRAY:
        if depth > 1:
            raise c.error(f"{key}: arrays nested deeper than 2")
        sub = c.scalar(4, f"array type of {key}")
        n = c.count(f"array length of {key}", struct.calcsize(SCALARS[sub][1]) if sub in SCALARS else 8)
        c.items += n
        if c.items > MAX_ARRAY_ITEMS:
            raise c.error(f"{key}: arrays of more than {MAX_ARRAY_ITEMS} items in all; not a GGUF ckptkit reads")
        if sub in SCALARS:
            name, fmt = SCALARS[sub]
            size = struct.calcsize(fmt)
            data = c.take(n * size, f"array {key}")
            items = list(struct.unpack(f"<{n}{fmt[1]}", data))
            if sub == 7:
                if any(v not in (0, 1) for v in items):
                    raise c.error(f"{key}: bool array holds a value other than 0 or 1")
                items = [bool(v) for v in items]
            return items, f"array[{name}]"
        if sub == STRING:
            return [c.string(f"item of {key}") for _ in range(n)], "array[string]"
        if sub == ARRAY:
            return [_value(c, ARRAY, key, depth + 1)[0] for _ in range(n)], "array[array]"
        raise c.error(f"{key}: unknown array item type {sub}")
    raise c.error(f"{key}: unknown value type {kind}")


def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, elements per block, bytes per block), from the gguf package."""
    import gguf

    return {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}


def read_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header, metadata and tensor infos; a one-line error for any lie."""
    src = open_source(path)
    with closing(src), Window(src) as f:
        size = src.size()
        c = _Cursor(f, path, size)
        if size < 4 or c.take(4, "magic") != MAGIC:
            raise CkptkitError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        version = c.scalar(4, "version")
        if version not in VERSIONS:
            raise CkptkitError(f"{path}: GGUF version {version}; ckptkit reads versions 2 and 3")
        n_tensors = c.count("tensor count", 24)
        n_kv = c.count("key/value count", 13)
        metadata: dict[str, Any] = {}
        types: dict[str, str] = {}
        for _ in range(n_kv):
            key = c.string("key", MAX_KEY_BYTES)
            if not key.isprintable():
                raise c.error(f"key {key!r} holds control characters")
            if key in metadata:
                raise c.error(f"key {key!r} appears twice")
            kind = c.scalar(4, f"type of {key}")
            metadata[key], types[key] = _value(c, kind, key)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if types.get("general.alignment", "uint32") != "uint32" or alignment <= 0 or alignment & (alignment - 1):
            raise c.error(f"general.alignment {alignment!r} is not a power of two (uint32)")
        ggml = _ggml_types()
        raw: list[tuple[str, tuple[int, ...], str, int, int]] = []
        names: set[str] = set()
        for _ in range(n_tensors):
            name = c.string("tensor name", MAX_KEY_BYTES)
            if not name.isprintable():
                raise c.error(f"tensor name {name!r} holds control characters")
            if name in names:
                raise c.error(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = c.scalar(4, f"dimension count of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.error(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
            dims = [c.scalar(10, f"dimension of {name}") for _ in range(n_dims)]
            type_id = c.scalar(4, f"type of {name}")
            if type_id not in ggml:
                raise c.error(f"tensor {name!r} has unknown GGML type {type_id}")
            kind, block, block_bytes = ggml[type_id]
            offset = c.scalar(10, f"offset of {name}")
            if any(d < 1 for d in dims) or dims[0] % block:
                raise c.error(f"tensor {name!r} has dimensions {dims} that {kind} blocks of {block} cannot hold")
            nbytes = math.prod(dims[1:]) * (dims[0] // block) * block_bytes
            if offset % alignment:
                raise c.error(f"tensor {name!r} at offset {offset}, not a multiple of the alignment {alignment}")
            raw.append((name, tuple(reversed(dims)), kind, offset, nbytes))
        data_start = -(-c.pos // alignment) * alignment
        header = GGUFHeader(path, version, metadata, types, [], alignment, data_start, size, c.read_bytes)
    for name, shape, kind, offset, nbytes in raw:
        if data_start + offset + nbytes > size:
            raise header.error(
                f"tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end of the file "
                f"({size} bytes): truncated or lying offsets"
            )
        header.tensors.append(GGUFTensorInfo(name, shape, kind, data_start + offset, nbytes))
    spans = sorted(header.tensors, key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise header.error(f"tensors {a.name!r} and {b.name!r} overlap in the file")
    return header


# --- typed access to metadata --------------------------------------------------------------------


def meta_str(h: GGUFHeader, key: str, default: str | None = None) -> str | None:
    value = h.metadata.get(key, default)
    if value is not None and not isinstance(value, str):
        raise h.error(f"metadata {key} must be a string, not {h.types[key]}")
    return value


def meta_int(h: GGUFHeader, key: str) -> int | None:
    value = h.metadata.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise h.error(f"metadata {key} must be an integer, not {h.types[key]}")
    return value


def meta_bool(h: GGUFHeader, key: str) -> bool | None:
    value = h.metadata.get(key)
    if value is not None and not isinstance(value, bool):
        raise h.error(f"metadata {key} must be a bool, not {h.types[key]}")
    return value


def meta_list(h: GGUFHeader, key: str, item: type | tuple[type, ...]) -> list[Any] | None:
    value = h.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, item) for v in value):
        raise h.error(f"metadata {key} must be an array of {getattr(item, '__name__', item)}, not {h.types[key]}")
    return value


def summary(h: GGUFHeader, longest: int = 16) -> dict[str, Any]:
    """The metadata for ``inspect``: arrays longer than ``longest`` as their type and length."""
    out: dict[str, Any] = {}
    for key, value in h.metadata.items():
        if isinstance(value, list) and len(value) > longest:
            out[key] = {"type": h.types[key], "length": len(value)}
        else:
            out[key] = value
    return out
