"""PEFT's adapter folder on disk: ``adapter_config.json`` + ``adapter_model.safetensors``
(or an older ``adapter_model.bin``), read and written with tensors as stored. What the
keys and config mean for a model is :mod:`ckptkit.train.peft_io`'s business."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.io import is_file, is_local, read_file

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter (its config file; weights are checked on read)."""
    return is_file(folder / ADAPTER_CONFIG)


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, or a one-line error naming the folder."""
    path = folder / ADAPTER_CONFIG
    if not is_file(path):
        raise CkptkitError(f"{folder} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    try:
        config = json.loads(read_file(path).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CkptkitError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CkptkitError(f"{path}: expected a JSON object")
    return config


def adapter_base(folder: Path, base: Path | None) -> Path:
    """The base checkpoint of an adapter: ``base`` (``--base``), else its config's
    ``base_model_name_or_path`` when that is a local path, else a one-line error asking for it."""
    if base is not None:
        return base
    named = read_adapter_config(folder).get("base_model_name_or_path")
    if isinstance(named, str) and named and Path(named).exists():
        return Path(named)
    where = f" ({named!r} in {ADAPTER_CONFIG} is not a local folder)" if named else ""
    raise CkptkitError(f"{folder}: which model is this adapter for{where}? pass --base BASE (its checkpoint)")


def read_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors, keys as stored; a ``.bin`` one without running pickled code."""
    from ckptkit.formats.safetensors_io import SafetensorsReader

    if is_file(folder / ADAPTER_WEIGHTS):
        reader = SafetensorsReader(folder / ADAPTER_WEIGHTS)
        try:
            return {name: reader.read(name) for name in reader.infos}  # in data order, as load_file gives
        finally:
            reader.close()
    if is_file(folder / ADAPTER_WEIGHTS_BIN):
        return _load_bin(folder / ADAPTER_WEIGHTS_BIN)
    raise CkptkitError(f"{folder} has no {ADAPTER_WEIGHTS}")


def write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``config`` and ``tensors`` as PEFT writes an adapter folder (safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` adapter: a plain dict of tensors, read without running pickled code."""
    import torch

    try:
        where = path if is_local(path) else io.BytesIO(read_file(path))
        tensors = torch.load(where, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickled objects, truncated zips...: the message says which file
        raise CkptkitError(
            f"{path}: not a plain file of tensors ({type(exc).__name__}); ckptkit runs no pickled code: "
            f"save the adapter as {ADAPTER_WEIGHTS}"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise CkptkitError(f"{path}: not a dict of tensors")
    return tensors
