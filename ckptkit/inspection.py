"""Metadata-only listing of a checkpoint directory or a single weight file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptkit.checkpoint import open_checkpoint, open_raw
from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.formats import detect_format, source_file_format
from ckptkit.formats.base import RawCheckpoint
from ckptkit.formats.single_file import read_single_file
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.hub import hub_source, parse_ref
from ckptkit.io import exists, is_dir


def inspect_path(path: str | Path, model_type: str | None = None, config: str | Path | None = None) -> dict[str, Any]:
    """Describe a checkpoint without reading tensor data.

    Returns the object ``ckptkit inspect --json`` prints.
    """
    if parse_ref(path) is not None:  # a Hub repository: headers by HTTP range, no weights fetched
        with hub_source(path, model_type=model_type, stream=True) as got:
            info = inspect_path(got.path, model_type, config)
        return {**info, "hub": got.to_json(), "source": got.describe()}
    p = Path(path)
    if not exists(p):
        raise CkptkitError(f"{p}: no such file or directory")
    if is_dir(p) or source_file_format(p) is not None:  # a checkpoint, folder or one file (GGUF)
        return _inspect_dir(p, model_type, None if config is None else Path(config))
    single = read_single_file(p)  # a weight file or an index: which ones, the format knows
    return _describe(single.format, None, single.files, single.infos, {i.name: i for i in single.infos})


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


def _inspect_dir(root: Path, model_type: str | None, config: Path | None) -> dict[str, Any]:
    reader = detect_format(root)
    fmt = reader.name
    try:
        with open_checkpoint(root, fmt, model_type, config) as ckpt:
            raw = ckpt.raw
            info = _describe(fmt, ckpt.family.name, list(raw.files), _per_file(raw), raw.infos)
            if ckpt.quant is not None:
                info["quantization"] = ckpt.quant.describe(ckpt.tensors)
            return reader.describe(raw, _with_ignored(info, raw))
    except UnknownModel:
        pass
    raw = open_raw(reader, root, config)  # an unknown model: still list what is there
    try:
        return reader.describe(
            raw, _with_ignored(_describe(fmt, None, list(raw.files), _per_file(raw), raw.infos), raw)
        )
    finally:
        raw.close()


def _with_ignored(info: dict[str, Any], raw: RawCheckpoint) -> dict[str, Any]:
    """``ignored``: entries besides the model (optimizer, train state) a format lists, if any."""
    return info | {"ignored": list(raw.ignored)} if raw.ignored else info
