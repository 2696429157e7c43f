"""A GGUF file cut into its sections as stored bytes, for comparing two files exactly in
well under a second.

llama.cpp's ``GGUFReader`` makes a numpy view per array element: a Llama 3 vocabulary
(128256 tokens, 280147 merges) takes it most of a minute on the 2-core CI machine. Equal
bytes are equal values to any reader, so ``test_gguf.assert_same_gguf`` compares these
sections, and :func:`kv_values` decodes the entries (strings, numbers, arrays of them) for
tests that read a large vocabulary; ``test_gguf.py`` checks that they split and decode a file
as ``GGUFReader`` reads it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types -> size of a scalar (8: string, 9: array are walked)
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class Sections:
    """A GGUF's key/value entries (key -> the entry's bytes: key, type, value) in file order,
    its tensors (name, GGML type, dims as stored) in file order, and each tensor's bytes."""

    kv: list[tuple[str, bytes]]
    tensors: list[tuple[str, int, tuple[int, ...]]]
    data: dict[str, bytes]


def _skip(buf: bytes, pos: int, vtype: int) -> int:
    """The position after a value of ``vtype`` stored at ``pos``."""
    if vtype in SCALAR_SIZES:
        return pos + SCALAR_SIZES[vtype]
    if vtype == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    assert vtype == ARRAY, f"unknown GGUF value type {vtype} at {pos}"
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in SCALAR_SIZES:
        return pos + count * SCALAR_SIZES[etype]
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        pos = _skip(buf, pos, etype) if etype != STRING else pos + 8 + unpack(buf, pos)[0]
    return pos


# GGUF scalar value types -> struct format (12 being float64)
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _decode(buf: bytes, pos: int, vtype: int) -> tuple[object, int]:
    """The value of ``vtype`` stored at ``pos`` (as ``GGUFReader``'s ``contents()`` gives it)
    and the position after it."""
    if vtype in SCALAR_FORMATS:
        return struct.unpack_from("<" + SCALAR_FORMATS[vtype], buf, pos)[0], pos + SCALAR_SIZES[vtype]
    if vtype == STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8"), pos + 8 + length
    assert vtype == ARRAY, f"unknown GGUF value type {vtype} at {pos}"
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in SCALAR_FORMATS:
        end = pos + count * SCALAR_SIZES[etype]
        return list(struct.unpack_from(f"<{count}{SCALAR_FORMATS[etype]}", buf, pos)), end
    items = []
    for _ in range(count):
        item, pos = _decode(buf, pos, etype)
        items.append(item)
    return items, pos


def kv_values(path: Path) -> dict[str, object]:
    """Each key/value entry of the GGUF at ``path`` decoded, in file order (a Llama 3
    vocabulary in about a second)."""
    values = {}
    for key, entry in read_sections(path).kv:
        at = 8 + len(key.encode("utf-8"))
        (vtype,) = struct.unpack_from("<I", entry, at)
        values[key], end = _decode(entry, at + 4, vtype)
        assert end == len(entry), f"{path}: {key} decodes to {end} of its {len(entry)} bytes"
    return values


def read_sections(path: Path) -> Sections:
    """``path`` cut into :class:`Sections`; tensor sizes from the ``gguf`` package's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = path.read_bytes()
    magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF", f"{path}: not a GGUF file"
    pos, kv, alignment = 24, [], 32
    for _ in range(n_kv):
        start = pos
        (length,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8 : pos + 8 + length].decode("utf-8")
        pos += 8 + length
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos = _skip(buf, pos + 4, vtype)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos - 4)
        kv.append((key, buf[start:pos]))
    infos = []
    for _ in range(n_tensors):
        (length,) = struct.unpack_from("<Q", buf, pos)
        name = buf[pos + 8 : pos + 8 + length].decode("utf-8")
        pos += 8 + length
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, ggml_type, tuple(dims), offset))
    start = -(-pos // alignment) * alignment
    data = {}
    for name, ggml_type, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        count = 1
        for d in dims:
            count *= d
        end = start + offset + count // block * size
        assert end <= len(buf), f"{path}: {name} runs past the end of the file"
        data[name] = buf[start + offset : end]
    return Sections(kv, [info[:3] for info in infos], data)
