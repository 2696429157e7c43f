"""Validation of a recorded origin layout (``ckptkit-origin.json``, ``ckptkit.json``).

The layout recorded when a checkpoint was converted decides file names, index and config
text when converting back, so a crafted or damaged record must never reach a path or the
output: every name is a plain base name matching its format's pattern, every text parses
as what it claims to be, every value has its type.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import zlib
from pathlib import Path
from typing import Any, NoReturn

from ckptkit.errors import CkptkitError, note
from ckptkit.formats.base import RawCheckpoint
from ckptkit.formats.format import CheckpointFormat
from ckptkit.formats.pickle_index import ARCHIVE_NAME, SERIALIZATION_ID
from ckptkit.formats.registry import find_format
from ckptkit.models.fields import check_config_fields
from ckptkit.tensors.dtypes import ITEMSIZE
from ckptkit.untrusted import loads_json, plain_name

MAX_RECORDED_TENSOR = 1 << 16  # LayoutRecord.own records only small unused tensors
MAX_RECORDED_FILE = 64 << 20  # a recorded tokenizer file (Llama 3's tokenizer.json: 9 MB)
SHA256 = re.compile(r"[0-9a-f]{64}")


def recorded_origin(fmt: CheckpointFormat, raw: RawCheckpoint) -> dict[str, Any] | None:
    """The layout recorded when ``raw``'s files were converted (``fmt.records.read``), if it
    is well formed and still matches them; else None, and a note on ``raw`` saying why the
    source layout will not be restored (the record is never used in part)."""
    try:
        found = fmt.records.read(raw)
        return None if found is None else check_origin(*found)
    except CkptkitError as e:
        lost = "so the source layout it records will not be restored: written in the default layout"
        raw.notes.append(note(f"{e}, {lost}"))
        return None


def _fail(where: Path, what: str) -> NoReturn:
    raise CkptkitError(f"{where}: invalid recorded layout ({what})")


def _need(ok: bool, where: Path, what: str) -> None:
    if not ok:
        _fail(where, what)


def _strings(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _archive(value: Any) -> bool:
    """A torch zip's recorded folder name and serialization id (pickle_index.archive_facts)."""
    if not _strings(value) or set(value) - {"archive", "serialization_id"}:
        return False
    ok = ARCHIVE_NAME.fullmatch(value.get("archive", "x")) is not None
    return ok and SERIALIZATION_ID.fullmatch(value.get("serialization_id", "0")) is not None


def check_origin(origin: Any, where: Path) -> dict[str, Any]:
    """``origin`` if it is a well-formed recorded layout; else a one-line error naming ``where``."""
    _need(isinstance(origin, dict), where, "not a JSON object")
    if not origin:
        return origin  # nothing recorded
    fmt = find_format(origin.get("format"))
    if fmt is None or fmt.info.config_file is None:  # a format never recorded as an origin: internal
        _fail(where, f"unknown format {origin.get('format')!r}")
    _need(isinstance(origin.get("model_type"), str), where, "model_type")
    files = origin.get("files")
    _need(isinstance(files, list) and bool(files), where, "files")
    pattern = fmt.info.weight_file
    names: list[str] = []
    placed: set[str] = set()
    for f in files:
        _need(isinstance(f, dict), where, "files")
        names.append(plain_name(f.get("name"), where, pattern, "recorded weight file name"))
        keys = f.get("keys")
        _need(isinstance(keys, list) and all(isinstance(k, str) for k in keys), where, f"keys of {names[-1]}")
        _need(f.get("metadata") is None or _strings(f["metadata"]), where, f"metadata of {names[-1]}")
        _need(f.get("archive") is None or _archive(f["archive"]), where, f"archive of {names[-1]}")
        placed.update(keys)
    _need(len(set(names)) == len(names), where, "a weight file name appears twice")
    split = origin.get("split_dims") or {}
    _need(isinstance(split, dict) and all(v in (None, 0, 1) for v in split.values()), where, "split_dims")
    _need(origin.get("dtypes") is None or _strings(origin["dtypes"]), where, "dtypes")
    _check_config(origin.get("config"), fmt, where)
    _check_index(origin.get("index"), fmt, names, placed, where)
    _check_unused(origin.get("unused") or {}, where)
    _check_tokenizer(origin.get("tokenizer"), where)
    return origin


def _check_config(config: Any, fmt: CheckpointFormat, where: Path) -> None:
    _need(isinstance(config, dict), where, "config")
    _need(config.get("name") == fmt.info.config_file, where, f"config name {config.get('name')!r}")
    _need(isinstance(config.get("text"), str), where, "config text")
    doc = loads_json(config["text"], where, f"invalid recorded {config['name']}")
    _need(isinstance(doc, dict), where, f"{config['name']} is not a JSON object")
    check_config_fields(config["name"], doc, f"{where} (recorded {config['name']})")


def _check_index(index: Any, fmt: CheckpointFormat, names: list[str], placed: set[str], where: Path) -> None:
    if index is None:
        return
    _need(fmt.info.index_name is not None and isinstance(index, dict), where, "index")
    _need(index.get("name") == fmt.info.index_name, where, f"index name {index.get('name')!r}")
    _need(isinstance(index.get("text"), str), where, "index text")
    doc = loads_json(index["text"], where, "invalid recorded index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    _need(_strings(weight_map), where, "the recorded index has no valid weight_map")
    _need(set(weight_map.values()) <= set(names), where, "the recorded index names other weight files")  # type: ignore[union-attr]
    _need(set(weight_map) == placed, where, "the recorded index lists other tensors than the files")  # type: ignore[arg-type]


def _check_unused(unused: Any, where: Path) -> None:
    _need(isinstance(unused, dict), where, "unused")
    for name, enc in unused.items():
        ok = isinstance(enc, dict) and enc.get("dtype") in ITEMSIZE and isinstance(enc.get("data"), str)
        shape = enc.get("shape") if ok else None
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        if ok and isinstance(shape, list):
            nbytes = math.prod(shape) * ITEMSIZE[enc["dtype"]]
            try:
                ok = nbytes <= MAX_RECORDED_TENSOR and len(base64.b64decode(enc["data"], validate=True)) == nbytes
            except (binascii.Error, ValueError):
                ok = False
        _need(ok, where, f"recorded tensor {name!r}")


def _check_tokenizer(record: Any, where: Path) -> None:
    """The recorded HF tokenizer files: plain names, each zlib-compressed base64 text that
    unpacks to at most :data:`MAX_RECORDED_FILE` bytes."""
    if record is None:
        return
    _need(isinstance(record, dict), where, "tokenizer")
    sha = record.get("model_sha256")
    _need(sha is None or (isinstance(sha, str) and SHA256.fullmatch(sha) is not None), where, "tokenizer model_sha256")
    _need(isinstance(record.get("model_in_hf", False), bool), where, "tokenizer model_in_hf")
    files = record.get("files")
    _need(isinstance(files, dict), where, "tokenizer files")
    for name, text in files.items():
        plain_name(name, where, None, "recorded tokenizer file name")
        ok = isinstance(text, str)
        if ok:
            try:
                unpack = zlib.decompressobj()
                data = unpack.decompress(base64.b64decode(text, validate=True), MAX_RECORDED_FILE)
                ok = unpack.eof and not unpack.unconsumed_tail and len(data) <= MAX_RECORDED_FILE
            except (binascii.Error, ValueError, zlib.error):
                ok = False
        _need(ok, where, f"recorded tokenizer file {name!r}")
