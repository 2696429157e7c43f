"""The few fields of a sentencepiece ``ModelProto`` that tokenizer conversion needs.

Read (and written) straight in the protobuf wire format, so that neither ``protobuf`` nor
sentencepiece's generated module is needed: pieces (text, score, type), the model type,
byte fallback, the special ids, and the normalizer settings that change how text is split
(the dummy ``▁`` prefix, whitespace handling, a precompiled normalization map).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.io import read_file

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


@dataclass
class Piece:
    text: str
    score: float = 0.0
    type: int = NORMAL


@dataclass
class SpmModel:
    pieces: list[Piece] = field(default_factory=list)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    vocab_size: int = 0
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message; varints as int, length-delimited as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            out.append((number, value))
        elif wire == 1:
            out.append((number, buf[pos : pos + 8]))
            pos += 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated field")
            out.append((number, buf[pos : pos + size]))
            pos += size
        elif wire == 5:
            out.append((number, buf[pos : pos + 4]))
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _signed(value: int) -> int:
    """int32 fields hold negative numbers as 64-bit two's complement varints."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _piece(buf: bytes) -> Piece:
    piece = Piece("")
    for number, value in _fields(buf):
        if number == 1 and isinstance(value, bytes):
            piece.text = value.decode("utf-8")
        elif number == 2 and isinstance(value, bytes):
            piece.score = struct.unpack("<f", value)[0]
        elif number == 3 and isinstance(value, int):
            piece.type = value
    return piece


def read_spm_model(path: Path) -> SpmModel:
    """Parse ``path`` as a sentencepiece model; a one-line error naming it when it is not one."""
    try:
        model = SpmModel()
        for number, value in _fields(bytes(read_file(path))):
            if number == 1 and isinstance(value, bytes):
                model.pieces.append(_piece(value))
            elif number == 2 and isinstance(value, bytes):  # TrainerSpec
                for n, v in _fields(value):
                    if isinstance(v, int):
                        if n == 3:
                            model.model_type = v
                        elif n == 4:
                            model.vocab_size = v
                        elif n == 24:
                            model.treat_whitespace_as_suffix = bool(v)
                        elif n == 35:
                            model.byte_fallback = bool(v)
                        elif n in (40, 41, 42, 43):
                            setattr(model, ("unk_id", "bos_id", "eos_id", "pad_id")[n - 40], _signed(v))
            elif number == 3 and isinstance(value, bytes):  # NormalizerSpec
                for n, v in _fields(value):
                    if n == 1 and isinstance(v, bytes):
                        model.normalizer_name = v.decode("utf-8")
                    elif n == 2 and isinstance(v, bytes):
                        model.precompiled_charsmap = v
                    elif n in (3, 4, 5) and isinstance(v, int):
                        name = ("add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces")[n - 3]
                        setattr(model, name, bool(v))
    except (ValueError, UnicodeDecodeError) as e:
        raise CkptkitError(f"{path}: not a sentencepiece model ({e})") from None
    if not model.pieces:
        raise CkptkitError(f"{path}: not a sentencepiece model (no pieces)")
    return model


def _key(number: int, wire: int) -> bytes:
    return _varint_bytes(number << 3 | wire)


def _varint_bytes(value: int) -> bytes:
    value &= (1 << 64) - 1  # int32 fields hold negative numbers as 64-bit two's complement
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _varint_bytes(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _key(number, 2) + _varint_bytes(len(value)) + value


def write_spm_model(model: SpmModel) -> bytes:
    """``model`` as a sentencepiece ``ModelProto`` (the fields :func:`read_spm_model` reads),
    loadable by sentencepiece itself."""
    out = bytearray()
    for piece in model.pieces:
        body = _bytes_field(1, piece.text.encode("utf-8")) + _key(2, 5) + struct.pack("<f", piece.score)
        if piece.type != NORMAL:
            body += _int_field(3, piece.type)
        out += _bytes_field(1, body)
    trainer = _int_field(3, model.model_type) + _int_field(4, model.vocab_size or len(model.pieces))
    trainer += _int_field(24, int(model.treat_whitespace_as_suffix)) + _int_field(35, int(model.byte_fallback))
    for number, value in zip((40, 41, 42, 43), (model.unk_id, model.bos_id, model.eos_id, model.pad_id), strict=True):
        trainer += _int_field(number, value)
    out += _bytes_field(2, trainer)
    normalizer = _bytes_field(1, model.normalizer_name.encode("utf-8"))
    if model.precompiled_charsmap:
        normalizer += _bytes_field(2, model.precompiled_charsmap)
    normalizer += _int_field(3, int(model.add_dummy_prefix)) + _int_field(4, int(model.remove_extra_whitespaces))
    normalizer += _int_field(5, int(model.escape_whitespaces))
    out += _bytes_field(3, normalizer)
    return bytes(out)
