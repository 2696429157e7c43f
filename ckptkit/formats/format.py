"""The protocol every checkpoint format implements, with the behaviour most formats share.

A format is one object (a :class:`CheckpointFormat` subclass instance) that its module
registers by name (:func:`ckptkit.formats.registry.register`). The reader asks it to
detect and open a directory and to say which family and config the metadata describes
and which native layout the tensors use; the converter asks it how to lay out files,
which metadata files to write and which writer writes each weight file. Nothing outside
``ckptkit/formats/`` branches on a format's name or a file's suffix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import ORIGIN_FILE, FilePlan, OpenedCheckpoint, Options, Plan, RawCheckpoint, read_json
from ckptkit.formats.containers import archive_facts, tensor_file_writer
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.writers import TensorWriter
from ckptkit.io import copy_file, is_file, size_of

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.lazy import Lazy


@dataclass(frozen=True)
class FormatInfo:
    """What a format's files are called and which options it takes: the facts the
    registry, the CLI and the converter read without opening anything.

    Attributes:
        expects: the files that identify it, for error messages.
        weight_file: the names its weight files may have (checked in recorded layouts;
            files of these names are never carried over as extra files).
        detect_order: lower is tried first when several formats could claim a directory.
        config_file: the metadata file a layout recorded from this format keeps
            (``config.json``, ``params.json``); None: never recorded as an origin.
        index_name: its index file (tensor name -> weight file), if it has one.
        metadata_names: the fixed-name files it writes besides weights and index.
        layer_field: the config field that gives the layer count, for error messages.
        loads_in_transformers: ``from_pretrained`` (and PEFT) read the folder as it is.
        sharding: how a fresh layout is split into files: "size" (``--max-shard-size``),
            "ranks" (``--shards N`` model-parallel ranks), or None (neither option applies).
        file_suffix: DST is one file whose name ends so, not a folder.
        reads_file: SRC may be one file of this format (``detect`` is asked about files).
        extra_dtypes: ``--dtype`` values only this format takes (``q8_0``).
        writes_adapters: SRC may be a PEFT LoRA adapter folder (``plan_adapter``).
        aliases: what users type meaning this format: the CLI's did-you-mean.
        lone_file: the names of a single weight or index file of this format, asked by
            ``inspect FILE``; None: no file of it is inspected alone.
        torchtune_checkpointers: the torchtune checkpointer components (``_component_`` of a
            recipe config's ``checkpointer:``) that read this format.
        holds_quantized: quantized weights are kept as stored, their scales beside them
            (:mod:`ckptkit.quant`), and ``--dtype fp8`` writes them.
    """

    expects: str
    weight_file: re.Pattern[str]
    detect_order: int = 50
    config_file: str | None = None
    index_name: str | None = None
    metadata_names: tuple[str, ...] = ()
    layer_field: str = "layers"
    loads_in_transformers: bool = False
    sharding: str | None = None
    file_suffix: str | None = None
    reads_file: bool = False
    extra_dtypes: tuple[str, ...] = ()
    writes_adapters: bool = False
    aliases: tuple[str, ...] = ()
    lone_file: re.Pattern[str] | None = None
    torchtune_checkpointers: tuple[str, ...] = ()
    holds_quantized: bool = False


class CheckpointFormat:
    """One on-disk format.

    Attributes:
        name: what ``--to`` / ``--from`` accept and ``inspect`` prints.
        info: its files and the options it takes (:class:`FormatInfo`).
        planner: how :meth:`plan` lays a folder of this format out: a
            :class:`ckptkit.formats.planning.FolderPlanner` subclass, made with the format.
    """

    name: ClassVar[str]
    info: FormatInfo
    planner: ClassVar[type[FolderPlanner]] = FolderPlanner

    # --- reading --------------------------------------------------------------------
    def detect(self, root: Path) -> bool:
        """Whether directory ``root`` holds this format (file names only, nothing read)."""
        raise NotImplementedError

    def open(self, root: Path) -> RawCheckpoint:
        """The raw view: config text, files and tensor metadata; tensors stay unread."""
        raise NotImplementedError

    def open_with_config(self, root: Path, config: Path | None) -> RawCheckpoint:
        """:meth:`open`, with the model config given apart (``--config``): for formats whose
        folders may lack one (DCP); the others carry their own and refuse it."""
        if config is not None:
            raise CkptkitError(
                f"--config: a {self.name} checkpoint carries its own model config; "
                "--config is for folders without one, such as DCP checkpoints"
            )
        return self.open(root)

    def family(self, raw: RawCheckpoint) -> Family:
        """The model family the metadata describes; an error asking for --model-type when unsure."""
        raise NotImplementedError

    def read_config(self, raw: RawCheckpoint, family: Family) -> ModelConfig:
        raise NotImplementedError

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        """The family's native tensor names and transforms in this format."""
        raise NotImplementedError

    def supports(self, family: Family) -> tuple[bool, bool]:
        """(reads, writes) checkpoints of ``family``: by default, whether the family has a
        layout in this format (asked with a small probe config)."""
        from ckptkit.models.config import ModelConfig

        probe = ModelConfig(family.name, 32, 16, 1, 2, 2, 8, 32, extra=family.fields())
        try:
            self.layout(family, probe)
        except CkptkitError:
            return False, False
        return True, True

    def describe(self, raw: RawCheckpoint, info: dict[str, Any]) -> dict[str, Any]:
        """What ``inspect`` prints of an opened checkpoint: ``info`` as built from the tensor
        infos by default; a format may add its own metadata or stored types."""
        return info

    def tokenizer_support(self, family: Family) -> str:
        """What a conversion into this format does with the tokenizer (support matrix)."""
        return "carried"

    def canonical_view(
        self, raw: RawCheckpoint, family: Family, cfg: ModelConfig
    ) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
        """(canonical tensors, native tensors the model does not use), lazily."""
        from ckptkit.formats.canonical import canonical_view

        return canonical_view(raw, self.layout(family, cfg), cfg)

    def read_origin(self, raw: RawCheckpoint) -> tuple[Any, Path] | None:
        """The layout recorded when these files were converted, if it still matches them,
        unchecked, with the file it came from (:func:`ckptkit.formats.sidecar.recorded_origin`
        checks it)."""
        path = raw.root / ORIGIN_FILE
        if not is_file(path):
            return None
        try:
            _, doc = read_json(path)
            written = doc["written"]
            sizes = {name: size_of(raw.root / name) for name in raw.files}
            if written["format"] != raw.format or written["files"] != sizes:
                return None
            return doc["origin"], path
        except (CkptkitError, KeyError, TypeError, OSError):
            return None

    def own_layout(self, ckpt: OpenedCheckpoint) -> dict[str, Any]:
        """This checkpoint's layout, as recorded for converting back to it later."""
        from ckptkit.tensors.dtypes import dtype_name
        from ckptkit.tensors.lazy import encode_lazy

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

    # --- writing --------------------------------------------------------------------
    def plan(self, ckpt: OpenedCheckpoint, opts: Options) -> Plan:
        """How ``ckpt`` is laid out in this format: every tensor to write, its file, order and
        ranks, and the metadata files; by default as :attr:`planner` plans a folder (the
        recorded layout restored, else laid out afresh)."""
        return self.planner(self).plan(ckpt, opts)

    def plan_adapter(self, adapter: Path, base: OpenedCheckpoint, opts: Options) -> Plan:
        """For a format that holds LoRA adapters (``info.writes_adapters``): the plan of the PEFT
        adapter folder ``adapter``, trained on the checkpoint ``base``."""
        raise NotImplementedError

    def writer(self, path: Path, plan: Plan, file: FilePlan, direct: bool) -> TensorWriter:
        """The writer of one output weight file of ``plan``: by default the container its
        name says (:func:`ckptkit.formats.containers.tensor_file_writer`)."""
        return tensor_file_writer(path, plan.entries(file), file.metadata, file.aliases, direct, file.archive)

    def finish(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        """Write the files beside the weights: the plan's metadata files, the source's
        layout (recorded so that converting back restores it exactly), and the source's
        other files (tokenizer, generation config) as the plan's tokenizer says."""
        for name, text in plan.metadata_files.items():
            (out_dir / name).write_text(text, encoding="utf-8")
        self.record_origin(ckpt, plan, out_dir)
        for extra in ckpt.extra_files():
            if extra.name not in plan.tokenizer.skip:
                copy_file(extra, out_dir / extra.name)
        for name, data in plan.tokenizer.files.items():
            (out_dir / name).write_bytes(data)

    def record_origin(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        """The source's layout, recorded beside the written weights (a sidecar)."""
        origin = ckpt.origin
        if plan.restored or origin.get("format") in (None, plan.format):
            return
        if plan.tokenizer.record is not None:  # tokenizer files this format does not hold
            origin = {**origin, "tokenizer": plan.tokenizer.record}
        sizes = {f.name: (out_dir / f.name).stat().st_size for f in plan.files}
        doc = {"written": {"format": plan.format, "files": sizes}, "origin": origin}
        (out_dir / ORIGIN_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def size_sharded_files(
    targets: dict[str, Lazy], opts: Options, pattern: str, single: str, safetensors: bool
) -> list[FilePlan]:
    """Shards of at most ``--max-shard-size`` named as huggingface_hub names them, each in
    the data order the writing library uses."""
    from huggingface_hub import split_state_dict_into_shards_factory

    from ckptkit.formats.safetensors_io import library_order

    try:
        split = split_state_dict_into_shards_factory(
            targets,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern=pattern,
            max_shard_size=opts.max_shard_size or DEFAULT_MAX_SHARD,
            get_storage_id=lambda t: None,
        )
    except ValueError as e:
        raise CkptkitError(f"--max-shard-size: {e}") from None
    metadata = {"format": "pt"} if safetensors else None
    files = []
    for name, keys in split.filename_to_tensors.items():
        if safetensors:
            keys = library_order([(k, targets[k].dtype, targets[k].shape) for k in keys])
        files.append(FilePlan(single if not split.is_sharded else name, keys, metadata))
    return files


DEFAULT_MAX_SHARD = "5GB"
