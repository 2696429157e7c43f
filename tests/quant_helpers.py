"""compressed-tensors, the reference implementation of its releases' quantization, for the
fixture script and the tests: its wheel (pure Python) and loguru's, unpacked once into the
test cache (the way :mod:`tokenizer_helpers` fetches packages), put on ``sys.path``; and
transformers' dequantizing MXFP4 load, made once per process."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tokenizer_helpers import _cache_lock, _pip_download, cache_dir

if TYPE_CHECKING:
    import torch

COMPRESSED_TENSORS = "0.20.0"
LOGURU = "0.7.3"  # what compressed-tensors imports besides torch, transformers and pydantic


def compressed_tensors() -> ModuleType:
    """The ``compressed_tensors`` package, version :data:`COMPRESSED_TENSORS`."""
    ready = cache_dir() / f"compressed-tensors-{COMPRESSED_TENSORS}"
    with _cache_lock():
        if not (ready / "compressed_tensors" / "__init__.py").is_file():
            ready.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=ready.parent))
            for pkg in (f"compressed-tensors=={COMPRESSED_TENSORS}", f"loguru=={LOGURU}"):
                wheel = _pip_download(pkg, staging, sdist=False)
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(staging)
                wheel.unlink()
            os.replace(staging, ready)
    if str(ready) not in sys.path:
        sys.path.append(str(ready))
    import compressed_tensors as ct

    assert ct.__version__ == COMPRESSED_TENSORS, ct.__version__
    return ct


@functools.cache
def mxfp4_dequantized(src: Path) -> dict[str, torch.Tensor]:
    """transformers' ``Mxfp4Config(dequantize=True)`` load of the MXFP4 release ``src``, as
    bfloat16 (its state dict; callers do not modify it)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True))
    return model.to(torch.bfloat16).state_dict()
