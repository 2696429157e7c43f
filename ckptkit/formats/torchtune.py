"""torchtune's Meta output: what its ``FullModelMetaCheckpointer`` saves, read as ``meta``.

torchtune writes the whole model with one ``torch.save`` of a Meta-named state dict,
``model-00001-of-00001.bin`` (in ``epoch_N/``; releases before 0.3 wrote
``meta_model_N.pt``), and copies ``params.json`` and the tokenizer beside it. Names, rope
order and dtypes are Meta's, so this module only has to find the file; everything else
is the Meta format's.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.io import entries, is_file

SINGLE_FILE = re.compile(r"meta_model_\d+\.pt|model-00001-of-00001\.bin")


def torchtune_files(root: Path) -> list[Path]:
    """The one torchtune Meta weight file in ``root`` (none: empty; several: an error)."""
    found = sorted(p for p in entries(root) if SINGLE_FILE.fullmatch(p.name) and is_file(p))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:3])
        raise CkptkitError(f"{root}: holds {len(found)} torchtune checkpoints ({names}); keep one per directory")
    return found
