"""Hugging Face layouts: ``config.json`` plus ``model*.safetensors`` (``hf``) or
``pytorch_model*.bin`` (``hf-bin``), single file or shards with an ``*.index.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import RawCheckpoint, TensorReader, natural_key, read_json, torch_reader
from ckptkit.formats.safetensors_io import SafetensorsReader
from ckptkit.formats.tensor_info import TensorInfo

STEMS = {"hf": ("model", ".safetensors"), "hf-bin": ("pytorch_model", ".bin")}


def index_name(fmt: str) -> str:
    stem, ext = STEMS[fmt]
    return f"{stem}{ext}.index.json"


def single_name(fmt: str) -> str:
    stem, ext = STEMS[fmt]
    return stem + ext


def shard_pattern(fmt: str) -> str:
    """The huggingface_hub filename pattern for shards of ``fmt``."""
    stem, ext = STEMS[fmt]
    return stem + "{suffix}" + ext


def weight_files(root: Path, fmt: str) -> list[Path]:
    stem, ext = STEMS[fmt]
    pattern = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}")
    return sorted((p for p in root.iterdir() if pattern.fullmatch(p.name)), key=lambda p: natural_key(p.name))


def detect(root: Path, fmt: str) -> bool:
    return (root / "config.json").is_file() and (bool(weight_files(root, fmt)) or (root / index_name(fmt)).is_file())


def open_raw(root: Path, fmt: str) -> RawCheckpoint:
    config_text, config = read_json(root / "config.json")
    index_path = root / index_name(fmt)
    index = None
    if index_path.is_file():
        text, data = read_json(index_path)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CkptkitError(f"{index_path}: has no weight_map")
        names = sorted(set(weight_map.values()), key=natural_key)
        for name in names:
            if not (root / name).is_file():
                raise CkptkitError(f"{index_path}: names shard {name}, which does not exist")
        index = {"name": index_path.name, "text": text}
    else:
        found = weight_files(root, fmt)
        if len(found) != 1 or found[0].name != single_name(fmt):
            raise CkptkitError(
                f"{root}: found {len(found)} weight files ({', '.join(p.name for p in found[:3])}) "
                f"but no {index_path.name} saying which tensor is where"
            )
        names, weight_map = [found[0].name], None
    readers: dict[str, TensorReader] = {}
    files: dict[str, list[str]] = {}
    infos: dict[str, TensorInfo] = {}
    file_metadata: dict[str, dict[str, str] | None] = {}
    for name in names:
        reader: Any = SafetensorsReader(root / name) if fmt == "hf" else torch_reader(root / name)
        readers[name] = reader
        files[name] = list(reader.infos)
        file_metadata[name] = reader.metadata if fmt == "hf" else None
        for key, info in reader.infos.items():
            if key in infos:
                raise CkptkitError(f"{root / name}: tensor {key!r} is also in {infos[key].file}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CkptkitError(
                    f"{index_path}: does not list tensor {key!r}, which {name} holds"
                    if key not in weight_map
                    else f"{index_path}: says {key!r} is in {weight_map[key]} but {name} holds it"
                )
            infos[key] = info
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in infos:
                raise CkptkitError(f"{index_path}: says {key!r} is in {name}, but {name} does not hold it")
    return RawCheckpoint(
        format=fmt,
        root=root,
        files=files,
        infos=infos,
        readers=readers,
        config_name="config.json",
        config_text=config_text,
        config=config,
        index=index,
        file_metadata=file_metadata,
    )


def index_text(fmt: str, weight_map: dict[str, str], total_size: int, total_parameters: int) -> str:
    """An index file as transformers writes it (sorted keys, two-space indent)."""
    metadata: dict[str, int] = {"total_size": total_size}
    if fmt == "hf":
        metadata["total_parameters"] = total_parameters
    return json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
