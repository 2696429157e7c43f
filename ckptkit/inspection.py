"""Metadata-only listing of a checkpoint directory or a single weight file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptkit.checkpoint import open_checkpoint
from ckptkit.errors import CkptkitError
from ckptkit.formats import REGISTRY, detect_format
from ckptkit.formats.base import RawCheckpoint, read_json, torch_reader
from ckptkit.formats.safetensors_io import SafetensorsReader
from ckptkit.formats.tensor_info import TensorInfo

READABLE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def inspect_path(path: str | Path, model_type: str | None = None) -> dict[str, Any]:
    """Describe a checkpoint without reading tensor data.

    Returns the object ``ckptkit inspect --json`` prints.
    """
    p = Path(path)
    if not p.exists():
        raise CkptkitError(f"{p}: no such file or directory")
    if p.is_dir():
        return _inspect_dir(p, model_type)
    if p.name.endswith(".index.json"):
        return _inspect_index(p)
    if p.suffix in READABLE_SUFFIXES:
        return _inspect_file(p)
    raise CkptkitError(f"{p}: not a weight file (expected .pth, .pt, .bin, .safetensors or *.index.json)")


def _describe(
    fmt: str, model_type: str | None, files: list[str], per_file: list[TensorInfo], merged: dict[str, TensorInfo]
) -> dict[str, Any]:
    return {
        "format": fmt,
        "model_type": model_type,
        "files": files,
        "num_params": sum(i.numel for i in merged.values()),
        "total_bytes": sum(i.nbytes for i in per_file),
        "tensors": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype, "file": i.file} for i in per_file],
    }


def _per_file(raw: RawCheckpoint) -> list[TensorInfo]:
    return [raw.readers[f].infos[k] for f, keys in raw.files.items() for k in keys]


def _inspect_dir(root: Path, model_type: str | None) -> dict[str, Any]:
    fmt = detect_format(root).name
    try:
        with open_checkpoint(root, fmt, model_type) as ckpt:
            raw = ckpt.raw
            return _describe(fmt, ckpt.family.name, list(raw.files), _per_file(raw), raw.infos)
    except CkptkitError as e:
        if "model type" not in str(e) and "model_type" not in str(e) and "which Llama" not in str(e):
            raise
    raw = REGISTRY[fmt].open(root)  # an unknown model: still list what is there
    try:
        return _describe(fmt, None, list(raw.files), _per_file(raw), raw.infos)
    finally:
        raw.close()


def _open_file(path: Path) -> Any:
    return SafetensorsReader(path) if path.suffix == ".safetensors" else torch_reader(path)


def _file_format(path: Path) -> str:
    """The format a lone weight or index file belongs to, else its container."""
    for fmt in REGISTRY.values():
        if fmt.owns_file(path.name):
            return fmt.name
    return "safetensors" if path.suffix == ".safetensors" else "torch"


def _inspect_file(path: Path) -> dict[str, Any]:
    reader = _open_file(path)
    try:
        infos = list(reader.infos.values())
        return _describe(_file_format(path), None, [path.name], infos, reader.infos)
    finally:
        reader.close()


def _inspect_index(path: Path) -> dict[str, Any]:
    _, doc = read_json(path)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CkptkitError(f"{path}: has no weight_map")
    names = sorted(set(weight_map.values()))
    infos: list[TensorInfo] = []
    for name in names:
        shard = path.parent / name
        if not shard.is_file():
            raise CkptkitError(f"{path}: names shard {name}, which does not exist")
        reader = _open_file(shard)
        infos += list(reader.infos.values())
        reader.close()
    return _describe(_file_format(path), None, names, infos, {i.name: i for i in infos})
