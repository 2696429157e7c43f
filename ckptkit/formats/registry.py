"""The format registry: every on-disk format ckptkit reads and writes, by name.

A format module registers its object(s) when imported (``register(MyFormat())``);
:mod:`ckptkit.formats` imports the built-in ones. The CLI's ``--to`` / ``--from``
choices, detection, ``inspect``, ``verify`` and the checks of recorded layouts all ask
this registry, so a new format needs no edit anywhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import ORIGIN_FILE, OpenedCheckpoint
from ckptkit.formats.containers import holds_weights
from ckptkit.formats.format import CheckpointFormat
from ckptkit.io import entries, exists, is_dir

if TYPE_CHECKING:
    from ckptkit.models.family import Family

REGISTRY: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` under ``fmt.name`` (a name already taken is an error); returns it."""
    if fmt.name in REGISTRY:
        raise ValueError(f"format {fmt.name!r} is already registered")
    REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove the format registered as ``name`` (tests that register their own)."""
    del REGISTRY[name]


PLUGIN_GROUP = "ckptkit.formats"
_plugins_loaded = False


def load_plugins() -> list[str]:
    """Register the formats other packages declare under the ``ckptkit.formats`` entry
    point group (``myformat = "mypkg.fmt:MyFormat"``): a CheckpointFormat subclass or
    object is registered; a module is only imported (it registers its own). Runs once
    per process; returns one line for each plugin that could not be loaded (the built-in
    formats work without it)."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    from importlib.metadata import entry_points

    failed = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            found = ep.load()
        except Exception as e:  # a broken plugin must not take the built-in formats with it
            failed.append(f"format plugin {ep.name} ({ep.value}) cannot be loaded and is left out: {e}")
            continue
        if isinstance(found, type) and issubclass(found, CheckpointFormat):
            found = found()
        if isinstance(found, CheckpointFormat) and found.name not in REGISTRY:
            register(found)
    return failed


def format_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(REGISTRY)


def find_format(name: object) -> CheckpointFormat | None:
    """The format registered as ``name``, or None (also for a name that is not a string)."""
    return REGISTRY.get(name) if isinstance(name, str) else None


def get_format(name: str) -> CheckpointFormat:
    found = find_format(name)
    if found is None:
        raise CkptkitError(f"unknown format {name!r}; choose one of {', '.join(REGISTRY)}")
    return found


def torchtune_checkpointers() -> tuple[str, ...]:
    """The torchtune checkpointer components that read some registered format."""
    return tuple(dict.fromkeys(c for f in REGISTRY.values() for c in f.info.torchtune_checkpointers))


def formats_read_by(component: str) -> tuple[str, ...]:
    """The names of the registered formats torchtune's checkpointer ``component`` reads."""
    return tuple(f.name for f in REGISTRY.values() if component in f.info.torchtune_checkpointers)


def formats_writing(family: Family) -> str:
    """The registered formats that write checkpoints of ``family``, as a sentence's list
    ("hf, hf-bin, internal or gguf")."""
    names = [f.name for f in REGISTRY.values() if f.support(family).writes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def transformers_format() -> CheckpointFormat:
    """The format to write for transformers (and PEFT) to load: the first registered one
    ``from_pretrained`` reads as it is (HF safetensors)."""
    return next(f for f in REGISTRY.values() if f.info.loads_in_transformers)


def detect_format(root: Path) -> CheckpointFormat:
    """The format of a checkpoint directory (or of a one-file checkpoint), or a one-line error."""
    if not exists(root):
        raise CkptkitError(f"{root}: no such file or directory")
    if not is_dir(root):
        found = source_file_format(root)
        if found is not None:
            return found
        files = [f.info.expects for f in REGISTRY.values() if f.info.reads_file]
        raise CkptkitError(f"{root}: expected a checkpoint directory" + "".join(f" or {e}" for e in files))
    for fmt in sorted(REGISTRY.values(), key=lambda f: f.info.detect_order):
        if fmt.detect(root):
            return fmt
    if not entries(root):
        raise CkptkitError(f"{root}: directory is empty")
    present = sorted(p.name for p in entries(root))
    for fmt in sorted(REGISTRY.values(), key=lambda f: f.info.detect_order):
        weights = [n for n in present if fmt.info.weight_file.fullmatch(n)]
        needed = fmt.info.config_file or next(iter(fmt.info.metadata_names), None)
        if weights and needed and needed not in present:
            raise CkptkitError(
                f"{root}: holds {fmt.name} weights ({weights[0]}) but no {needed}; copy the {needed} that came "
                f"with them into the folder (it gives the model's shape)"
            )
    names = list(dict.fromkeys(f.info.expects for f in REGISTRY.values()))
    raise CkptkitError(f"{root}: not a recognised checkpoint (expected {', '.join(names[:-1])}, or {names[-1]})")


def source_file_format(path: Path) -> CheckpointFormat | None:
    """The format of a checkpoint that is one file (GGUF), if some format reads ``path`` as one."""
    if is_dir(path):
        return None
    return next(
        (
            f
            for f in sorted(REGISTRY.values(), key=lambda f: f.info.detect_order)
            if f.info.reads_file and f.detect(path)
        ),
        None,
    )


def holds_hf_files(ckpt: OpenedCheckpoint) -> bool:
    """Whether ``ckpt`` holds an HF folder's tokenizer files as they were (an HF layout, or
    one recorded as its origin by a format that keeps them): such files are carried byte
    for byte between HF layouts and none are generated."""
    fmt = get_format(ckpt.raw.format)
    return fmt.planner(fmt).keeps_hf_files(ckpt.origin)


def file_format(name: str) -> CheckpointFormat | None:
    """The format a lone weight or index file of this name belongs to, if any."""
    return next((f for f in REGISTRY.values() if f.info.lone_file and f.info.lone_file.fullmatch(name)), None)


def is_checkpoint_file(name: str) -> bool:
    """Whether a file of this name is part of some format's checkpoint (weights, index,
    config or ckptkit's own records) rather than a file to carry over (tokenizer, README)."""
    if name == ORIGIN_FILE or holds_weights(name):
        return True
    return any(
        f.info.weight_file.fullmatch(name) or name in f.info.metadata_names or name == f.info.index_name
        for f in REGISTRY.values()
    )
