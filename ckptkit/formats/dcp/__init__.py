"""PyTorch Distributed Checkpoints (DCP): a folder with ``.metadata`` and ``__R_N.distcp``
files, as ``torch.distributed.checkpoint.save`` writes them from one process or N ranks
(FSDP2, torchtitan), registered as the ``dcp`` format.

- :mod:`~ckptkit.formats.dcp.metadata`: ``.metadata`` read by a restricted unpickler
  (nothing in it runs), as plain data;
- :mod:`~ckptkit.formats.dcp.reading`: tensors stitched from their chunks, as byte ranges;
- :mod:`~ckptkit.formats.dcp.folder`: ``step-N`` folders, the model config, model keys
  (top level or under ``model.``, both torchtitan spellings) and the state beside them;
- :mod:`~ckptkit.formats.dcp.writing`: ``__R_0.distcp`` archives filled in place, ``.metadata``;
- :mod:`~ckptkit.formats.dcp.format`: the registered format.

What the trainer uses of it (its own sharded recipe state) is this package's public face:
:func:`holds_checkpoint`, :func:`state_keys`, :func:`open_state`.
"""

from __future__ import annotations

from pathlib import Path

from ckptkit.formats.dcp import format as _format  # noqa: F401  (registers "dcp")
from ckptkit.formats.dcp.folder import open_state
from ckptkit.formats.dcp.metadata import METADATA, read_metadata
from ckptkit.formats.dcp.reading import DcpCheckpoint


def holds_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` itself is a DCP checkpoint (its ``.metadata`` is there)."""
    return (folder / METADATA).is_file()


def state_keys(folder: Path) -> set[str]:
    """Every key a DCP checkpoint stores, flattened as torch stores them
    (``optimizer.state.x.exp_avg``), read by the restricted reader: a ``.metadata`` holding
    anything torch does not write there is refused with one line, and nothing in it runs."""
    md = read_metadata(folder / METADATA)
    return {*md.tensors, *md.others}


__all__ = ["DcpCheckpoint", "holds_checkpoint", "open_state", "state_keys"]
