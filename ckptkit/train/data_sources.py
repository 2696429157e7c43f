"""Dataset rows: local files of any format Hugging Face ``datasets`` reads, Hub names, bundled data.

Rows come back as ``(where, row)`` pairs, ``where`` naming the file and line (JSON Lines)
or row for error messages. JSON and JSON Lines files are read without ``datasets`` when
it is not installed; every other source needs it (``pip install 'ckptkit[train]'``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ckptkit.errors import CkptkitError, ConfigError

DATASET_DIR = Path(__file__).parent / "datasets"
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
Row = tuple[str, dict[str, Any]]


def resolve_source(source: str) -> Path | str:
    """A local file or folder, a bundled dataset (``tiny_alpaca``), or else a Hub dataset name."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    parts = source.split("/")
    if len(parts) == 1 and not path.is_absolute():
        for candidate in sorted(DATASET_DIR.glob(f"{source}.*")):
            return candidate
    if not path.is_absolute() and path.suffix not in BUILDERS and len(parts) <= 2 and all(parts):
        return source  # owner/name on the Hub
    raise ConfigError(f"config key dataset.source: {source}: no such file, folder or bundled dataset")


def load_rows(source: str, split: str, column_map: dict[str, str] | None = None) -> list[Row]:
    """The rows of ``split`` of ``source``, with ``column_map`` (our name -> the data's column) applied."""
    where = resolve_source(source)
    if isinstance(where, Path) and where.parent == DATASET_DIR and where.suffix == ".jsonl" and split == "train":
        rows = read_json_rows(where)  # a bundled dataset: ours, read without importing `datasets` (seconds)
    elif isinstance(where, Path) and where.suffix in (".json", ".jsonl") and not _have_datasets():
        if split != "train":
            raise CkptkitError(
                f"dataset.split: {split!r} of a JSON file needs `datasets`: pip install 'ckptkit[train]'"
            )
        rows = read_json_rows(where)
    else:
        if isinstance(where, Path) and where.is_file() and where.suffix in TEXT_SUFFIXES:
            read_utf8(where)  # the file and line of a bad byte, before `datasets` fails on it
        rows = _rows_via_datasets(where, split)
    if column_map:
        rows = [(label, _renamed(label, row, column_map)) for label, row in rows]
    return rows


def hold_out(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(training rows, validation rows): a seeded random ``fraction`` (at least one row) held out."""
    n_val = max(1, round(len(rows) * fraction))
    if n_val >= len(rows):
        raise CkptkitError(f"dataset.validation_fraction={fraction} leaves no training rows out of {len(rows)}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_val])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


TEXT_SUFFIXES = (".json", ".jsonl", ".txt", ".csv", ".tsv")


def read_utf8(path: Path) -> str:
    """The text of dataset file ``path``; a one-line error naming the line and byte offset
    of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CkptkitError(
            f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); save it as UTF-8"
        ) from None


def read_json_rows(path: Path) -> list[Row]:
    """Rows of a JSON Lines file or a JSON list, each labelled with its line or item number."""
    text = read_utf8(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise CkptkitError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        return [(f"{path}: item {i + 1}", row) for i, row in enumerate(items)]
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise CkptkitError(f"{path}:{n}: invalid JSON: {e.msg}") from None
    return rows


def _renamed(label: str, row: dict[str, Any], column_map: dict[str, str]) -> dict[str, Any]:
    out = dict(row)
    for ours, theirs in column_map.items():
        if theirs not in row:
            raise CkptkitError(f"{label}: dataset.column_map: no column {theirs!r} (columns: {', '.join(row)})")
        out[ours] = row[theirs]
    return out


def _have_datasets() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def _rows_via_datasets(where: Path | str, split: str) -> list[Row]:
    if not _have_datasets():
        raise CkptkitError(f"dataset.source: reading {where} needs `datasets`: pip install 'ckptkit[train]'")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)  # failures become our one-line error below
    try:
        if isinstance(where, Path) and where.is_dir() and any((where / f).is_file() for f in _SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(where))  # a Dataset(Dict).save_to_disk folder
            data = loaded[_split_name(split)] if isinstance(loaded, datasets.DatasetDict) else loaded
        elif isinstance(where, Path) and where.is_file():
            builder = BUILDERS.get(where.suffix, where.suffix[1:])
            data = datasets.load_dataset(builder, data_files=str(where), split=split)
        else:
            data = datasets.load_dataset(str(where), split=split)
    except Exception as exc:  # datasets and pyarrow raise many types; keep the first line
        if isinstance(where, Path) and where.suffix in (".json", ".jsonl"):
            read_json_rows(where)  # names the bad line, if there is one
        cause = exc.__cause__ or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CkptkitError(f"dataset.source: {where}: cannot load split {split!r}: {first}") from None
    label = _labeller(where, split)
    return [(label(i), dict(row)) for i, row in enumerate(data)]


_SAVED_MARKERS = ("dataset_dict.json", "state.json")


def _split_name(split: str) -> str:
    return split.split("[", 1)[0]


def _labeller(where: Path | str, split: str) -> Any:
    """Row index -> ``file:line`` for a whole JSON Lines file, else ``source: row N``."""
    if isinstance(where, Path) and where.suffix == ".jsonl" and split == "train":
        lines = [n for n, line in enumerate(where.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
        return lambda i: f"{where}:{lines[i]}"
    return lambda i: f"{where} [{split}]: row {i + 1}"
