"""The format registry: every on-disk format ckptkit reads and writes, by name.

Adding a format is one module with a :class:`~ckptkit.formats.format.CheckpointFormat`
subclass and one line here; the CLI's ``--to`` / ``--from`` choices follow.
"""

from __future__ import annotations

from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.formats.format import CheckpointFormat
from ckptkit.formats.hf import HFFormat
from ckptkit.formats.internal import InternalFormat
from ckptkit.formats.meta import MetaFormat

REGISTRY: dict[str, CheckpointFormat] = {
    f.name: f
    for f in (
        MetaFormat(),
        HFFormat("hf", "model", ".safetensors"),
        HFFormat("hf-bin", "pytorch_model", ".bin"),
        InternalFormat(),
    )
}
FORMATS = tuple(REGISTRY)

__all__ = ["FORMATS", "REGISTRY", "CheckpointFormat", "detect_format", "get_format"]


def get_format(name: str) -> CheckpointFormat:
    try:
        return REGISTRY[name]
    except KeyError:
        raise CkptkitError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None


def detect_format(root: Path) -> CheckpointFormat:
    """The format of a checkpoint directory, or a one-line error."""
    if not root.exists():
        raise CkptkitError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise CkptkitError(f"{root}: expected a checkpoint directory")
    for fmt in sorted(REGISTRY.values(), key=lambda f: f.detect_order):
        if fmt.detect(root):
            return fmt
    if not any(root.iterdir()):
        raise CkptkitError(f"{root}: directory is empty")
    names = list(dict.fromkeys(f.expects for f in REGISTRY.values()))
    raise CkptkitError(f"{root}: not a recognised checkpoint (expected {', '.join(names[:-1])}, or {names[-1]})")
