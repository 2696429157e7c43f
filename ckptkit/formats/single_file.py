"""One weight file or index read on its own (``ckptkit inspect FILE``): which format owns
it, which files it names and their tensors, from headers only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import read_json
from ckptkit.formats.containers import READABLE_DESCRIPTION, container_name, is_index, is_readable, open_tensor_file
from ckptkit.formats.registry import file_format
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import is_file


@dataclass
class SingleFile:
    """format: the registered format that owns the name, else the container
    (``safetensors``, ``torch``); files: the weight files read; infos: their tensors."""

    format: str
    files: list[str]
    infos: list[TensorInfo]


def read_single_file(path: Path) -> SingleFile:
    """The tensors of one weight file, or of the shards an index names; a one-line error
    for any other file."""
    if is_index(path.name):
        return _index(path)
    if is_readable(path.name):
        reader = open_tensor_file(path)
        try:
            return SingleFile(_format_of(path.name), [path.name], list(reader.infos.values()))
        finally:
            reader.close()
    raise CkptkitError(f"{path}: not a weight file (expected {READABLE_DESCRIPTION})")


def _format_of(name: str) -> str:
    fmt = file_format(name)
    return fmt.name if fmt is not None else container_name(name)


def _index(path: Path) -> SingleFile:
    _, doc = read_json(path)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CkptkitError(f"{path}: has no weight_map")
    names = sorted(set(weight_map.values()))
    infos: list[TensorInfo] = []
    for name in names:
        shard = path.parent / name
        if not is_file(shard):
            raise CkptkitError(f"{path}: names shard {name}, which does not exist")
        reader = open_tensor_file(shard)
        infos += list(reader.infos.values())
        reader.close()
    return SingleFile(_format_of(path.name), names, infos)
