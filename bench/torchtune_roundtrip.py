"""torchtune's load + save of a Llama 2 checkpoint: the peer ``bench/convert.py`` times.

    python bench/torchtune_roundtrip.py hf SRC_DIR OUT_DIR     # FullModelHFCheckpointer
    python bench/torchtune_roundtrip.py meta SRC_DIR OUT_DIR   # FullModelMetaCheckpointer

This is what a torchtune recipe does around training: ``load_checkpoint()`` (read every
shard into one state dict and convert it to torchtune's layout, permuting q/k for HF) and
``save_checkpoint()`` (convert back and write the same format into ``OUT_DIR/epoch_0``).
Needs torchtune (0.6.1 was measured; install it with ``--no-deps`` beside torch 2.13).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path


def main(fmt: str, src: Path, out: Path) -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from torchtune.training.checkpointing import FullModelHFCheckpointer, FullModelMetaCheckpointer

    if fmt == "hf":
        files = sorted(p.name for p in src.glob("model-*.safetensors"))
        ckpt = FullModelHFCheckpointer(str(src), files, "LLAMA2", str(out))
    else:
        files = sorted(p.name for p in src.glob("consolidated.*.pth"))
        ckpt = FullModelMetaCheckpointer(str(src), files, "LLAMA2", str(out))
    state = ckpt.load_checkpoint()
    ckpt.save_checkpoint(state, epoch=0)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("hf", "meta"):
        raise SystemExit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
