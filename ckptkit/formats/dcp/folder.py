"""A DCP checkpoint folder: where its ``.metadata`` is (the folder, or its newest ``step-N``),
its model config (``params.json`` / ``config.json`` in it or beside the ``step-N`` folders, or
``--config``), which entries are the model's (top level or under ``model.``; torchtitan's 2026
spelling read as Meta's names) and which are training state beside it (listed, left alone).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.formats.base import TensorReader, natural_key, read_json
from ckptkit.formats.dcp.metadata import METADATA, Entry, check_tiling, read_metadata
from ckptkit.formats.dcp.reading import DcpCheckpoint, FileInfos
from ckptkit.formats.pickle_index import BYTE_DTYPES
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.torch_zip import STORAGE_OF
from ckptkit.io import entries, is_file, is_local, size_of
from ckptkit.models.fields import check_config_fields

DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
STEP = re.compile(r"step-(\d+)")
PARAMS, HF_CONFIG = "params.json", "config.json"
MODEL_PREFIX = "model."
# First components of the state torchtitan and FSDP2 trainers save beside the model.
STATE_PREFIXES = ("optimizer", "optim", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state")


def meta_name(name: str) -> str:
    """torchtitan's 2026 spelling -> Meta's (the earlier spelling is Meta's already)."""
    if name == "lm_head.weight":
        return "output.weight"
    if name.endswith(".moe.expert_bias_E"):  # torchtitan's MoE router bias (DeepSeek V3)
        return name.removesuffix("_E")
    return re.sub(r"\.attention\.qkv_linear\.(w[qkv])\.", r".attention.\1.", name)


def titan_name(name: str) -> str:
    """Meta's spelling (or a layout's ``layers.{i}.`` template of it) -> torchtitan's 2026 one."""
    if name == "output.weight":
        return "lm_head.weight"
    return re.sub(r"\.attention\.(w[qkv])\.", r".attention.qkv_linear.\1.", name)


def model_keys(keys: Iterable[str]) -> list[str]:
    """The model's keys among a DCP folder's tensor keys, without their ``model.`` prefix."""
    keys = list(keys)
    prefixed = any(k.startswith(MODEL_PREFIX) for k in keys)
    return [
        k.removeprefix(MODEL_PREFIX) if prefixed else k
        for k in keys
        if not (prefixed and not k.startswith(MODEL_PREFIX) or k.split(".", 1)[0] in STATE_PREFIXES)
    ]


def spelled_2026(root: Path) -> bool:
    """Whether the DCP checkpoint of ``root`` names its model tensors in torchtitan's 2026
    spelling (``qkv_linear.wq``, ``lm_head``); False also where its ``.metadata`` cannot be
    read (opening it then says why)."""
    folder = checkpoint_folder(root)
    if folder is None:
        return False
    if not is_local(folder / METADATA):  # no modification time to cache it by
        return bool(_spelled_2026.__wrapped__(folder / METADATA, 0, 0))
    try:
        st = os.stat(folder / METADATA)
    except OSError:
        return False
    return _spelled_2026(folder / METADATA, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _spelled_2026(path: Path, mtime_ns: int, size: int) -> bool:
    """:func:`spelled_2026` of one ``.metadata`` (as of ``mtime_ns``, ``size``): both DCP
    format objects ask while detecting, the file is read once."""
    try:
        keys = read_metadata(path).tensors
    except CkptkitError:
        return False
    return any(meta_name(k) != k for k in model_keys(keys))


def checkpoint_folder(root: Path) -> Path | None:
    """The DCP folder of ``root``: itself, or its newest ``step-N`` folder with a ``.metadata``."""
    if is_file(root / METADATA):
        return root
    try:
        steps = [p for p in entries(root) if STEP.fullmatch(p.name) and is_file(p / METADATA)]
    except OSError:
        return None
    if not steps:
        return None
    return max(steps, key=lambda p: int(STEP.fullmatch(p.name).group(1)))  # type: ignore[union-attr]


def _config_kind(path: Path, doc: dict[str, Any]) -> str:
    if "n_layers" in doc or "dim" in doc:
        return PARAMS
    if "model_type" in doc or "num_hidden_layers" in doc:
        return HF_CONFIG
    raise UnknownModel(f"{path}: neither a params.json (dim, n_layers) nor a config.json (model_type)")


def find_config(folder: Path, root: Path, given: Path | None) -> Path:
    if given is not None:
        if not given.is_file():
            raise CkptkitError(f"{given}: --config: no such file")
        return given
    for where in dict.fromkeys((folder, root)):
        for name in (PARAMS, HF_CONFIG):
            if is_file(where / name):
                return where / name
    raise UnknownModel(
        f"{folder}: a DCP folder without a model config (params.json or config.json) names no model type or dims; "
        "pass --config params.json|config.json"
    )


def check_entry(folder: Path, entry: Entry, sizes: dict[str, int]) -> None:
    """A tensor of ``folder``'s ``.metadata`` can be read: a dtype ckptkit reads, chunks that
    tile it, each inside an ``__R_N.distcp`` file of the folder (``sizes``: file sizes seen)."""
    fqn = entry.fqn
    if entry.dtype not in STORAGE_OF and entry.dtype not in BYTE_DTYPES:
        raise CkptkitError(f"{folder / METADATA}: {fqn!r} has dtype {entry.dtype}, which ckptkit cannot read")
    check_tiling(entry, folder / METADATA)
    for c in entry.chunks:
        if not DISTCP.fullmatch(c.file):
            raise CkptkitError(f"{folder / METADATA}: invalid storage file name {c.file!r} (expected __R_N.distcp)")
        if c.file not in sizes:
            try:
                sizes[c.file] = size_of(folder / c.file)
            except OSError:
                raise CkptkitError(f"{folder / c.file}: missing (.metadata places {fqn!r} there)") from None
        if c.offset < 0 or c.length <= 0 or c.offset + c.length > sizes[c.file]:
            where = f"bytes {c.offset}..{c.offset + c.length} of a {sizes[c.file]}-byte file"
            why = f".metadata places a chunk of {fqn!r} at {where} (truncated file or wrong offsets)"
            raise CkptkitError(f"{folder / c.file}: {why}")


def open_dcp(root: Path, config: Path | None, fmt: str) -> DcpCheckpoint:
    """A DCP checkpoint as format ``fmt`` reads it: the model's tensors by Meta name, a model config."""
    folder = checkpoint_folder(root)
    if folder is None:
        raise CkptkitError(f"{root}: not a DCP checkpoint (no .metadata, nor step-N folders holding one)")
    md = read_metadata(folder / METADATA)
    config_path = find_config(folder, root, config)
    text, doc = read_json(config_path)
    kind = _config_kind(config_path, doc)
    check_config_fields(kind, doc, config_path)
    prefixed = any(k.startswith(MODEL_PREFIX) for k in md.tensors)
    entries: dict[str, Entry] = {}
    ignored = list(md.others)
    sizes: dict[str, int] = {}
    for fqn, entry in md.tensors.items():
        if prefixed and not fqn.startswith(MODEL_PREFIX) or fqn.split(".", 1)[0] in STATE_PREFIXES:
            ignored.append(fqn)
            continue
        name = meta_name(fqn.removeprefix(MODEL_PREFIX) if prefixed else fqn)
        if name in entries:
            raise CkptkitError(f"{folder / METADATA}: {fqn!r} and {entries[name].fqn!r} are the same tensor")
        check_entry(folder, entry, sizes)
        entries[name] = entry
    if not entries:
        raise CkptkitError(f"{folder / METADATA}: holds no model tensors")
    per_file: dict[str, dict[str, TensorInfo]] = {}
    for name, entry in entries.items():
        for c in entry.chunks:
            infos = per_file.setdefault(c.file, {})
            if name in infos:  # two chunks of one tensor in one file: list them as one
                infos[name] = TensorInfo(name, (infos[name].numel + c.numel,), entry.dtype, c.file)
            else:
                infos[name] = TensorInfo(name, c.sizes, entry.dtype, c.file)
    files = sorted(per_file, key=natural_key)
    readers: dict[str, TensorReader] = {f: FileInfos(per_file[f]) for f in files}  # type: ignore[misc]
    return DcpCheckpoint(
        format=fmt,
        root=folder,
        files={f: list(per_file[f]) for f in files},
        infos={n: TensorInfo(n, e.shape, e.dtype, e.chunks[0].file) for n, e in entries.items()},
        readers=readers,
        config_name=str(config_path.relative_to(folder)) if config_path.parent == folder else str(config_path),
        config_text=text,
        config=doc,
        entries=entries,
        ignored=ignored,
        hf_config=kind == HF_CONFIG,
    )


def open_state(folder: Path, prefix: str) -> DcpCheckpoint:
    """The tensors stored under ``prefix`` in DCP folder ``folder``, by their names without it:
    a trainer's own state, read as saved (no model config, no renaming)."""
    md = read_metadata(folder / METADATA)
    entries: dict[str, Entry] = {}
    sizes: dict[str, int] = {}
    for fqn, entry in md.tensors.items():
        if fqn.startswith(prefix):
            check_entry(folder, entry, sizes)
            entries[fqn.removeprefix(prefix)] = entry
    empty: dict[str, Any] = {}
    return DcpCheckpoint("dcp", folder, empty, empty, empty, "", "", empty, entries=entries, ignored=list(md.others))
