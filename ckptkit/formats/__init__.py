"""Every on-disk format ckptkit reads and writes: one module each, registered by name.

A format module defines a :class:`~ckptkit.formats.format.CheckpointFormat` subclass and
registers its object(s) with :func:`~ckptkit.formats.registry.register` when imported;
importing this package imports the built-in ones (``meta``, ``hf`` / ``hf-bin``,
``internal``, ``dcp``, ``gguf``, in the order the CLI lists them). The CLI's ``--to`` / ``--from`` choices,
detection and ``inspect`` follow the registry.
"""

from __future__ import annotations

# isort: off
# Each registers its formats on import, in this order: the order --to / --from list them.
from ckptkit.formats import meta  # noqa: F401
from ckptkit.formats import hf  # noqa: F401
from ckptkit.formats import internal  # noqa: F401
from ckptkit.formats import dcp  # noqa: F401
from ckptkit.formats import gguf  # noqa: F401

# isort: on
from ckptkit.formats.format import CheckpointFormat
from ckptkit.formats.registry import (
    REGISTRY,
    detect_format,
    file_format,
    find_format,
    format_names,
    formats_read_by,
    get_format,
    is_checkpoint_file,
    load_plugins,
    register,
    source_file_format,
    torchtune_checkpointers,
    transformers_format,
    unregister,
)
from ckptkit.formats.sidecar import recorded_origin

__all__ = [
    "REGISTRY", "CheckpointFormat", "detect_format", "file_format", "find_format", "format_names", "formats_read_by",
    "get_format", "is_checkpoint_file", "load_plugins", "recorded_origin", "register", "source_file_format",
    "torchtune_checkpointers", "transformers_format", "unregister",
]  # fmt: skip
