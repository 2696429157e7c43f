"""Meta's layout: ``consolidated.00.pth`` ... ``consolidated.NN.pth`` (one per
model-parallel rank) + ``params.json``; Mistral's ``consolidated.safetensors`` reads the same.

Ranks are merged on read: column-parallel tensors on dim 0, row-parallel on dim 1,
``tok_embeddings`` on whichever dim its shard shape shows, the rest replicated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import RawCheckpoint, TensorReader, natural_key, read_json, torch_reader
from ckptkit.formats.safetensors_io import SafetensorsReader
from ckptkit.formats.tensor_info import TensorInfo

RANK_FILE = re.compile(r"consolidated\.(\d{2})\.pth")
SAFETENSORS_FILE = "consolidated.safetensors"
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


def rank_file(rank: int) -> str:
    return f"consolidated.{rank:02d}.pth"


def split_dim(name: str, ndim: int, vocab_parallel: bool) -> int | None:
    """The dim Meta's model-parallel ranks split tensor ``name`` on (None: replicated)."""
    stem = name.removesuffix(".weight")
    if ndim < 2:
        return None
    if stem == "tok_embeddings":
        return 0 if vocab_parallel else 1
    if stem.endswith(COLUMN_PARALLEL):
        return 0
    if stem.endswith(ROW_PARALLEL):
        return 1
    return None


def weight_files(root: Path) -> list[Path]:
    ranks = sorted((p for p in root.iterdir() if RANK_FILE.fullmatch(p.name)), key=lambda p: natural_key(p.name))
    if ranks:
        return ranks
    single = root / SAFETENSORS_FILE
    return [single] if single.is_file() else []


def detect(root: Path) -> bool:
    return (root / "params.json").is_file() and bool(weight_files(root))


def open_raw(root: Path) -> RawCheckpoint:
    config_text, params = read_json(root / "params.json")
    paths = weight_files(root)
    for i, p in enumerate(paths):
        if p.name not in (rank_file(i), SAFETENSORS_FILE):
            raise CkptkitError(f"{root}: model-parallel ranks are not numbered 00..{len(paths) - 1:02d} ({p.name})")
    readers: dict[str, TensorReader] = {}
    files: dict[str, list[str]] = {}
    for p in paths:
        reader: Any = SafetensorsReader(p) if p.suffix == ".safetensors" else torch_reader(p)
        readers[p.name], files[p.name] = reader, list(reader.infos)
    first = paths[0].name
    for name, keys in files.items():
        if set(keys) != set(files[first]):
            odd = sorted(set(keys) ^ set(files[first]))[:3]
            raise CkptkitError(f"{root / name}: holds different tensors than {first} ({', '.join(odd)})")
    infos: dict[str, TensorInfo] = {}
    split_dims: dict[str, int | None] = {}
    n = len(paths)
    dim = int(params.get("dim", 0))
    for key in files[first]:
        shards = [readers[f].infos[key] for f in files]
        shape = shards[0].shape
        if any(s.shape != shape or s.dtype != shards[0].dtype for s in shards):
            raise CkptkitError(f"{root}: tensor {key!r} has different shapes or dtypes across ranks")
        d = None
        if n > 1:
            # tok_embeddings: Llama 2 splits the hidden dim, Llama 3 the vocabulary.
            d = split_dim(key, len(shape), vocab_parallel=len(shape) == 2 and shape[1] == dim)
            if d is not None:
                shape = tuple(s * n if i == d else s for i, s in enumerate(shape))
        split_dims[key] = d
        infos[key] = TensorInfo(key, shape, shards[0].dtype, first)
    return RawCheckpoint(
        format="meta",
        root=root,
        files=files,
        infos=infos,
        readers=readers,
        config_name="params.json",
        config_text=config_text,
        config=params,
        file_metadata={f: getattr(r, "metadata", None) for f, r in readers.items()},
        split_dims=split_dims if n > 1 else {},
    )
