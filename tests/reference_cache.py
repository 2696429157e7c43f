"""Reference outputs of llama.cpp's converters, kept in the test cache by what went in.

A converter run costs seconds (its start imports torch and transformers) and gives the same
bytes for the same inputs: the converter script and its arguments, the input folder's files
(and its name, which llama.cpp writes as ``general.name``), the llama.cpp release and the
versions of the packages it reads them with. Keyed by the SHA-256 of all of those, a run's
output files are stored once under ``cache_dir()/llama-cpp-outputs`` and copied out again
on the next run with the same key: a changed fixture, script or package runs the converter
again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from tokenizer_helpers import LLAMA_CPP_PYTHON, _cache_lock, cache_dir

# What the converters import besides gguf-py (vendored with them, so fixed by LLAMA_CPP_PYTHON).
PACKAGES = ("torch", "transformers", "tokenizers", "sentencepiece", "numpy", "safetensors", "protobuf", "tiktoken")


def _versions() -> list[str]:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return found


def _file_bytes(path: Path) -> bytes:
    """The file's bytes; PEFT's adapter_config.json with its ``target_modules`` sorted (PEFT
    writes a set there, in an order that changes with every interpreter's hash seed)."""
    data = path.read_bytes()
    if path.name == "adapter_config.json":
        doc = json.loads(data)
        if isinstance(doc.get("target_modules"), list):
            doc["target_modules"] = sorted(doc["target_modules"])
        data = json.dumps(doc, sort_keys=True).encode()
    return data


def _folder_digest(folder: Path, h: hashlib._Hash) -> None:
    h.update(folder.name.encode() + b"\0")
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0")
            h.update(hashlib.sha256(_file_bytes(p)).digest())


def cached_outputs(inputs: list[Path], args: list[str], outs: list[Path], run: Callable[[], None]) -> None:
    """Make ``outs`` as ``run()`` would from ``inputs`` (folders) and ``args`` (everything else
    that decides the bytes, paths given relative to nothing that varies), from the cache when
    the same run was made before; otherwise call ``run()`` and store what it wrote."""
    h = hashlib.sha256()
    for part in [LLAMA_CPP_PYTHON, *_versions(), *args, str(len(outs))]:
        h.update(part.encode() + b"\0")
    for folder in inputs:
        _folder_digest(folder, h)
    entry = cache_dir() / "llama-cpp-outputs" / h.hexdigest()
    if not all((entry / str(i)).is_file() for i in range(len(outs))):
        run()
        with _cache_lock():
            if not entry.is_dir():
                entry.parent.mkdir(parents=True, exist_ok=True)
                staging = Path(tempfile.mkdtemp(dir=entry.parent))
                for i, out in enumerate(outs):
                    shutil.copyfile(out, staging / str(i))
                os.rename(staging, entry)
        return
    for i, out in enumerate(outs):
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry / str(i), out)
