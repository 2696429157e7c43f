"""Which files of a Hub repository make one checkpoint (for :mod:`ckptkit.hub`):
exactly one weight set (HF safetensors,
else ``.bin``, else Meta's ``original/``) and the small files beside it, never a second copy of
the same weights in another format (``original/``, ``metal/``, ``onnx/``, ``*.gguf``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ckptkit.errors import CkptkitError

# Files that hold weights in some format: taken only as the chosen set's own weight files.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".onnx",
    ".onnx_data",
    ".h5",
    ".msgpack",
    ".ot",
    ".ckpt",
    ".npz",
    ".tflite",
    ".mlmodel",
    ".pdparams",
    ".nemo",
)
SIDE_LIMIT = 64 << 20  # a side file (config, tokenizer, template) larger than this is not taken
_HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_BIN_SHARD = re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin$")
_META_SHARD = re.compile(r"^consolidated\.\d{2}\.pth$")


@dataclass(frozen=True)
class Selection:
    """One checkpoint in a repository: its format, its folder (relative to the repository
    root, "" for the root), and its files (relative to that folder), weights last."""

    format: str
    folder: str
    side: tuple[str, ...]
    weights: tuple[str, ...]

    @property
    def files(self) -> tuple[str, ...]:
        return self.side + self.weights


def _in(folder: str, names: list[str]) -> list[str]:
    """The files directly in ``folder`` (no deeper), relative to it."""
    prefix = f"{folder}/" if folder else ""
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix) and "/" not in n[len(prefix) :])


def choose(
    names: dict[str, int], folder: str, from_format: str | None, read_small: Callable[[str], bytes], where: str
) -> Selection:
    """The one weight set of the repository files ``names`` (path -> size) under ``folder``.

    ``from_format`` picks one (``hf``, ``hf-bin``, ``meta``, ``gguf``); otherwise HF safetensors,
    else ``.bin``, else ``original/``. ``read_small`` fetches an index file to learn its shards.
    """
    here = _in(folder, list(names))
    sub = f"{folder}/" if folder else ""

    def side_of(files: list[str], index: str) -> tuple[str, ...]:
        """The small files beside the weights: not weights, not another weight set's index."""
        return tuple(
            n
            for n in files
            if not n.endswith(WEIGHT_SUFFIXES)
            and not (n.endswith(".index.json") and n != index)
            and names[sub + n] <= SIDE_LIMIT
        )

    def from_index(index: str, pattern: re.Pattern[str]) -> tuple[str, ...] | None:
        if index in here:
            try:
                shards = sorted(set(json.loads(read_small(sub + index))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise CkptkitError(f"{where}: {sub}{index} is not a weight index (weight_map)") from None
            if not all(isinstance(s, str) for s in shards):
                raise CkptkitError(f"{where}: {sub}{index} is not a weight index (weight_map)")
            missing = [s for s in shards if s not in here]
            if missing:
                raise CkptkitError(f"{where}: {sub}{index} names shards the repository lacks: {', '.join(missing[:3])}")
            return tuple(shards)
        found = tuple(n for n in here if pattern.match(n))
        return found or None

    want = from_format
    if want in (None, "hf") and (w := from_index("model.safetensors.index.json", _HF_SHARD)):
        return Selection("hf", folder, side_of(here, "model.safetensors.index.json"), w)
    if want in (None, "hf-bin") and (w := from_index("pytorch_model.bin.index.json", _BIN_SHARD)):
        return Selection("hf-bin", folder, side_of(here, "pytorch_model.bin.index.json"), w)
    if want in (None, "meta"):
        for meta_folder in (folder, f"{sub}original") if want == "meta" else (f"{sub}original",):
            files = _in(meta_folder, list(names))
            shards = tuple(n for n in files if _META_SHARD.match(n))
            if shards and "params.json" in files:
                msub = f"{meta_folder}/" if meta_folder else ""
                side = tuple(n for n in files if not n.endswith(WEIGHT_SUFFIXES) and names[msub + n] <= SIDE_LIMIT)
                return Selection("meta", meta_folder, side, shards)
    if want == "gguf":
        raise CkptkitError(f"{where}: name the GGUF file: hf://{where}/FILE.gguf (with --from gguf)")
    kinds = sorted({n.rsplit(".", 1)[-1] for n in names if n.endswith(WEIGHT_SUFFIXES)})
    asked = f" in the {want} format" if want else ""
    raise CkptkitError(
        f"{where}: no checkpoint{asked} ckptkit reads in {sub or 'the repository root'} "
        f"(weight files there: {', '.join(kinds) or 'none'})"
    )


def choose_file(names: dict[str, int], path: str, where: str) -> Selection:
    """A single-file checkpoint (a ``.gguf``) named by its path in the repository."""
    if path not in names:
        raise CkptkitError(f"{where}: the repository has no file {path}")
    folder, _, name = path.rpartition("/")
    return Selection("gguf", folder, (), (name,))


# a name ending so is a file, never a Hub repository name (``out/model.gguf``, ``a/config.json``)
FILE_NAME_SUFFIXES = (".json", ".gguf", ".safetensors")


def is_single_file(path: str) -> bool:
    """Whether ``path`` in a repository names a one-file checkpoint (a ``.gguf``)."""
    return path.lower().endswith(".gguf")


def single_file_format(fmt: str) -> bool:
    """Whether the selection of format ``fmt`` is one file (its path is the file's)."""
    return fmt == "gguf"


def has_hf_config(fmt: str) -> bool:
    """Whether a checkpoint of format ``fmt`` has transformers' ``config.json`` (read before any weights)."""
    return fmt in ("hf", "hf-bin")
