"""ckptkit's own layout: canonical tensor names in safetensors plus ``ckptkit.json``,
which holds the model config and the origin layout so converting back is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import INTERNAL_FILE, RawCheckpoint, TensorReader, read_json
from ckptkit.formats.safetensors_io import SafetensorsReader
from ckptkit.formats.tensor_info import TensorInfo

UNUSED_PREFIX = "_unused."  # tensors the model does not use, under their origin names
SINGLE = "weights.safetensors"
PATTERN = "weights{suffix}.safetensors"
VERSION = 1


def detect(root: Path) -> bool:
    return (root / INTERNAL_FILE).is_file()


def open_raw(root: Path) -> RawCheckpoint:
    text, doc = read_json(root / INTERNAL_FILE)
    if doc.get("format") != "internal" or doc.get("version") != VERSION:
        raise CkptkitError(f"{root / INTERNAL_FILE}: not a ckptkit internal checkpoint (version {VERSION})")
    files: dict[str, list[str]] = {}
    readers: dict[str, TensorReader] = {}
    infos: dict[str, TensorInfo] = {}
    for name, keys in doc.get("files", {}).items():
        path = root / name
        if not path.is_file():
            raise CkptkitError(f"{root / INTERNAL_FILE}: names weight file {name}, which does not exist")
        reader: Any = SafetensorsReader(path)
        if set(reader.infos) != set(keys):
            raise CkptkitError(f"{path}: does not hold the tensors {INTERNAL_FILE} lists for it")
        readers[name], files[name] = reader, list(reader.infos)
        infos.update(reader.infos)
    return RawCheckpoint(
        format="internal",
        root=root,
        files=files,
        infos=infos,
        readers=readers,
        config_name=INTERNAL_FILE,
        config_text=text,
        config=doc,
        file_metadata={f: r.metadata for f, r in readers.items()},  # type: ignore[attr-defined]
    )
