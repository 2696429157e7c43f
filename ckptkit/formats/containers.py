"""The file containers tensors are stored in, told apart by file name: safetensors and
torch pickles (``torch.save`` zips).

Formats pick a container per file with :func:`open_tensor_file` (read) and
:func:`tensor_file_writer` (write); this is the one place that knows which suffix is
which container. Nothing outside ``ckptkit/formats/`` compares a file suffix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckptkit.formats.base import TensorReader
from ckptkit.formats.safetensors_io import SafetensorsReader, SafetensorsWriter
from ckptkit.formats.writers import TensorWriter

if TYPE_CHECKING:
    import torch

SAFETENSORS = ".safetensors"
PICKLE_SUFFIXES = (".pth", ".pt", ".bin")
READABLE_SUFFIXES = (SAFETENSORS, *PICKLE_SUFFIXES)  # what open_tensor_file reads
WEIGHT_SUFFIXES = (*READABLE_SUFFIXES, ".gguf")  # files that hold tensors, read here or not
INDEX_SUFFIX = ".index.json"  # an HF shard index: tensor name -> shard file
READABLE_DESCRIPTION = ".pth, .pt, .bin, .safetensors or *.index.json"

Entries = Sequence[tuple[str, "torch.dtype | str", tuple[int, ...]]]


def is_safetensors(name: str) -> bool:
    return name.endswith(SAFETENSORS)


def is_readable(name: str) -> bool:
    """Whether :func:`open_tensor_file` reads a file of this name."""
    return name.endswith(READABLE_SUFFIXES)


def is_index(name: str) -> bool:
    return name.endswith(INDEX_SUFFIX)


def holds_weights(name: str) -> bool:
    """Whether a file of this name holds tensors (or indexes them) in any container ckptkit knows."""
    return Path(name).suffix in WEIGHT_SUFFIXES or is_index(name)


def container_name(name: str) -> str:
    """``safetensors`` or ``torch``: what ``inspect`` calls a file no format owns."""
    return "safetensors" if is_safetensors(name) else "torch"


class TensorFile(TensorReader, Protocol):
    """A reader of one safetensors file or torch pickle, with what the file holds besides
    tensors: ``metadata``, a safetensors file's ``__metadata__`` (None: a pickle), and
    ``aliases``, tensors a pickle stores as another tensor's storage -> that tensor."""

    metadata: dict[str, str] | None
    aliases: dict[str, str]


def open_tensor_file(path: Path) -> TensorFile:
    """A lazy reader for one safetensors file or torch pickle (headers only; torch is
    imported for a pickle's first tensor read)."""
    if is_safetensors(path.name):
        return SafetensorsReader(path)
    from ckptkit.formats.torch_io import TorchPickleReader  # imports torch, which safetensors work avoids

    return TorchPickleReader(path)


def tensor_file_writer(
    path: Path,
    entries: Entries,
    metadata: dict[str, str] | None,
    aliases: dict[str, str],
    direct: bool,
    archive: dict[str, str] | None = None,
) -> TensorWriter:
    """The writer for one output file, by its name: a safetensors file (with ``metadata``)
    or a torch pickle (with ``aliases``: tensors stored as another one's storage, and
    ``archive``: the zip facts of the file it restores, see :func:`archive_facts`)."""
    if is_safetensors(path.name):
        return SafetensorsWriter(path, entries, metadata, direct=direct)
    from ckptkit.formats.torch_writer import TorchPickleWriter

    return TorchPickleWriter(path, entries, aliases, direct=direct, facts=archive)


def archive_facts(path: Path) -> dict[str, str] | None:
    """For a torch pickle, what its bytes hold that its tensors and layout do not decide
    (the zip's folder name, its serialization id); None for other containers."""
    if is_safetensors(path.name) or not is_readable(path.name):
        return None
    from ckptkit.formats.pickle_index import archive_facts as zip_facts

    return zip_facts(path)
