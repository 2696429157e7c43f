"""Open any supported checkpoint as canonical tensors plus the layout it came from."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats import CheckpointFormat, detect_format, get_format, is_checkpoint_file, recorded_origin
from ckptkit.formats.base import RawCheckpoint
from ckptkit.io import copy_file, entries, is_file
from ckptkit.models import ModelConfig, get_family
from ckptkit.models.family import Family
from ckptkit.models.fields import check_layer_count
from ckptkit.quant import Quantization, bound, found_quantization, source_quant_config
from ckptkit.quant.modelopt import HF_QUANT_CONFIG
from ckptkit.tensors.lazy import Lazy, decode_tensor, encode_tensor
from ckptkit.tokenization import TOKENIZER_FILES, supplied_tokenizer
from ckptkit.untrusted import check_source_folder

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checkpoint", "Lazy", "decode_tensor", "encode_tensor", "load_checkpoint", "open_checkpoint", "tokenizer_from",
]  # fmt: skip


@dataclass
class Checkpoint:
    """A checkpoint seen as canonical tensors.

    Attributes:
        tensors: canonical name -> lazy tensor, in canonical order.
        unused: native name -> lazy tensor the model does not use (``rope.freqs``...).
        origin: the layout to restore when converting back to ``origin["format"]``:
            this checkpoint's own, or the one recorded when it was converted.
    """

    path: Path
    format: str
    family: Family
    config: ModelConfig
    raw: RawCheckpoint
    tensors: dict[str, Lazy]
    unused: dict[str, Lazy]
    recorded_origin: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    side_override: Path | None = None  # set by :func:`tokenizer_from`
    quant: Quantization | None = None  # quantized weights (``tensors`` holds them as stored) and their scales

    @property
    def fmt(self) -> CheckpointFormat:
        return get_format(self.format)

    @functools.cached_property
    def own_layout(self) -> dict[str, Any]:
        """This checkpoint's layout, as recorded for converting back to it later."""
        return self.fmt.records.own(self)

    @property
    def origin(self) -> dict[str, Any]:
        return self.recorded_origin if self.recorded_origin is not None else self.own_layout

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def side_folder(self) -> Path:
        """Where the non-weight files (tokenizer, generation config) are: beside the weights,
        or in a folder the format made for them (a GGUF's, rebuilt from its metadata), or
        their copy with the tokenizer ``--tokenizer`` gives (:func:`tokenizer_from`)."""
        return self.side_override or self.raw.files_folder() or self.path

    def extra_files(self) -> list[Path]:
        """Top-level non-weight files to carry over (tokenizer, generation config, ...)."""
        skip = {self.raw.config_name, *self.raw.files}
        if self.raw.index:
            skip.add(self.raw.index["name"])
        out = []
        for p in entries(self.side_folder):
            if not is_file(p) or p.name in skip or p.name.startswith("."):
                continue
            if is_checkpoint_file(p.name) or p.name == HF_QUANT_CONFIG:
                continue  # some format's weights, index or config (a kept quantization is in config.json)
            out.append(p)
        return out


@contextlib.contextmanager
def tokenizer_from(ckpt: Checkpoint, path: str | Path | None) -> Iterator[Checkpoint]:
    """``ckpt`` with the tokenizer files at ``path`` (``--tokenizer``: see
    :func:`~ckptkit.tokenization.supplied_tokenizer`) in place of its own, while the context
    lasts: its side folder is then a temporary copy of its other non-weight files and those."""
    if path is None:
        yield ckpt
        return
    given = supplied_tokenizer(Path(path))
    with tempfile.TemporaryDirectory(prefix="ckptkit-tokenizer-") as tmp:
        side = Path(tmp) / "files"
        side.mkdir()
        for extra in ckpt.extra_files():
            if extra.name not in TOKENIZER_FILES:
                copy_file(extra, side / extra.name)
        for name, src in given.items():
            copy_file(src, side / name)
        ckpt.side_override = side
        try:
            yield ckpt
        finally:
            ckpt.side_override = None


def open_checkpoint(
    path: str | Path,
    fmt: str | None = None,
    model_type: str | None = None,
    config: str | Path | None = None,
    check_model_type: bool = False,
) -> Checkpoint:
    """Open a checkpoint directory read-only; nothing but headers is read yet (and the few
    tiny tensors a quantization's shapes depend on: per-channel packed ``weight_shape``).

    ``model_type`` overrides detection; with ``check_model_type`` one that contradicts what
    the files say (detection is sure of another) is an error. ``config``: the model config
    file for a folder without one (``--config``, DCP).
    """
    root = Path(path)
    if root.is_dir():
        check_source_folder(root)
    reader = get_format(fmt) if fmt else detect_format(root)
    raw = open_raw(reader, root, config)
    try:
        stored = dict(raw.infos)  # the scales are hidden from the model's view, then put back
        folder = root if root.is_dir() else None
        found = found_quantization(source_quant_config(raw.config, folder), raw.infos, root / raw.config_name, raw.read)
        given = get_family(model_type) if model_type else None
        if model_type and check_model_type:
            _check_model_type(reader, raw, model_type)
        family, cfg = reader.model(raw, given)
        cfg = family.refine_config(cfg, raw.infos)
        where = root / raw.config_name if root.is_dir() else root
        check_layer_count(cfg.num_layers, family.layer_names(cfg, raw.infos), where, reader.info.layer_field)
        tensors, unused = reader.canonical_view(raw, family, cfg)
        quant = None
        if found is not None:
            raw.infos.clear()
            raw.infos.update(stored)
            raw.stored_names.update(found.renamed)
            quant = bound(found, _rules(reader, family, cfg), tensors, raw, cfg)
            raw.notes.extend(quant.notes())
        origin = recorded_origin(reader, raw)
        # the format's notes, shared: it may add some when asked for its side folder later
        return Checkpoint(root, reader.name, family, cfg, raw, tensors, unused, origin, raw.notes, quant=quant)
    except BaseException:
        raw.close()
        raise


def open_raw(reader: CheckpointFormat, root: Path, config: str | Path | None = None) -> RawCheckpoint:
    """``reader.open(root)``, with the model config ``config`` given apart (``--config``) to a
    format whose folders may lack one; refused for the others, which carry their own."""
    if config is not None and not reader.info.takes_config:
        raise CkptkitError(
            f"--config: a {reader.name} checkpoint carries its own model config; "
            "--config is for folders without one, such as DCP checkpoints"
        )
    return reader.open(root, None if config is None else Path(config))


def _rules(reader: CheckpointFormat, family: Family, cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], Any]]:
    """(native, canonical, transform) of each of the format's rules; none for a format
    that stores canonical names (internal)."""
    try:
        rules = reader.layout(family, cfg).expand(cfg.num_layers)
    except (NotImplementedError, CkptkitError):
        return []
    return [(r.native, r.canonical, r.kind) for r in rules]


def _check_model_type(reader: CheckpointFormat, raw: RawCheckpoint, model_type: str) -> None:
    try:
        detected = reader.model(raw)[0].name
    except CkptkitError:
        return  # detection is unsure: the given type decides
    if detected != model_type:
        raise CkptkitError(
            f"{raw.root / raw.config_name}: describes a {detected} model, not {model_type}; drop --model-type, "
            f"or pass --force-model-type to read it as {model_type} anyway"
        )


def load_checkpoint(path: str | Path, model_type: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load any checkpoint as (canonical config, canonical state dict), dtypes as stored."""
    with open_checkpoint(path, model_type=model_type) as ckpt:
        return ckpt.config, {k: v.get() for k, v in ckpt.tensors.items()}
