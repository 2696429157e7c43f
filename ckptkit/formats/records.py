"""Where a format keeps layouts: the layout a checkpoint was converted from, recorded with
what it was converted to, and a checkpoint's own layout, recorded for converting back.

A format names its :class:`LayoutRecord` (``CheckpointFormat.records``): by default a
``ckptkit-origin.json`` sidecar beside the written weights and the checkpoint's own layout
recorded in full, so that converting back restores every file as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import ORIGIN_FILE, OpenedCheckpoint, Plan, RawCheckpoint, read_json
from ckptkit.formats.containers import archive_facts
from ckptkit.io import is_file, size_of
from ckptkit.tensors.dtypes import dtype_name
from ckptkit.tensors.lazy import encode_lazy


class LayoutRecord:
    """How a format's checkpoints record layouts.

    ``sidecar``: the layout a checkpoint was converted from is kept in a ``ckptkit-origin.json``
    beside its weights (False: a format that keeps none, GGUF). ``restores``: a checkpoint's
    own layout is recorded, to be restored when converting back to the format (False: it is
    laid out afresh each time, as DCP folders and GGUF files are).
    """

    def __init__(self, sidecar: bool = True, restores: bool = True) -> None:
        self.sidecar, self.restores = sidecar, restores

    def read(self, raw: RawCheckpoint) -> tuple[Any, Path] | None:
        """The layout recorded when ``raw``'s files were converted, unchecked, with the file it
        came from (:func:`ckptkit.formats.sidecar.recorded_origin` checks it); None: none
        recorded; a one-line CkptkitError when the record is damaged or was written for other
        files."""
        path = raw.root / ORIGIN_FILE
        if not self.sidecar or not is_file(path):
            return None
        _, doc = read_json(path)  # a one-line CkptkitError when it is not a JSON object
        written = doc.get("written")
        if not isinstance(written, dict) or "origin" not in doc:
            raise CkptkitError(f"{path}: invalid recorded layout (no 'written' and 'origin' records)")
        try:
            sizes = {name: size_of(raw.root / name) for name in raw.files}
        except OSError as e:
            raise CkptkitError(f"{path}: cannot compare with the weight files ({e.strerror})") from None
        if written.get("format") != raw.format or written.get("files") != sizes:
            raise CkptkitError(f"{path}: recorded for other weight files than these (changed since)")
        return doc["origin"], path

    def own(self, ckpt: OpenedCheckpoint) -> dict[str, Any]:
        """``ckpt``'s own layout, as recorded for converting back to it later ({}: never restored)."""
        if not self.restores:
            return {}
        raw = ckpt.raw
        small = {k: v for k, v in ckpt.unused.items() if v.nbytes <= 1 << 16}
        archives = {name: archive_facts(raw.root / name) for name in raw.files}
        return {
            "format": raw.format,
            "model_type": ckpt.family.name,
            "files": [
                {"name": name, "keys": keys, "metadata": raw.file_metadata.get(name)}
                | ({"aliases": raw.file_aliases[name]} if raw.file_aliases.get(name) else {})
                | ({"archive": archives[name]} if archives[name] else {})
                for name, keys in raw.files.items()
            ],
            "dtypes": {k: dtype_name(i.dtype) for k, i in raw.infos.items()},
            "split_dims": raw.split_dims,
            "config": {"name": raw.config_name, "text": raw.config_text},
            "index": raw.index,
            "unused": {k: encode_lazy(v) for k, v in small.items()},
        }

    def write(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        """The source's layout, recorded beside the weights ``plan`` wrote into ``out_dir``."""
        origin = ckpt.origin
        if not self.sidecar or plan.restored or origin.get("format") in (None, plan.format):
            return
        if plan.tokenizer.record is not None:  # tokenizer files this format does not hold
            origin = {**origin, "tokenizer": plan.tokenizer.record}
        sizes = {f.name: (out_dir / f.name).stat().st_size for f in plan.files}
        doc = {"written": {"format": plan.format, "files": sizes}, "origin": origin}
        (out_dir / ORIGIN_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
