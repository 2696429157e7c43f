"""The protocol every checkpoint format implements, with the behaviour most formats share.

A format is one object (a :class:`CheckpointFormat` subclass instance) that its module
registers by name (:func:`ckptkit.formats.registry.register`). The reader asks it to
detect and open a directory and to say which family and config the metadata describes
and which native layout the tensors use; the converter asks it for the plan of the
output (files, order, metadata files and the writer of each weight file) and to finish
it (what lies beside the weights). Nothing outside
``ckptkit/formats/`` branches on a format's name or a file's suffix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import FilePlan, OpenedCheckpoint, Options, Plan, RawCheckpoint
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.records import LayoutRecord
from ckptkit.io import copy_file, entries, is_file

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
        takes_pre_tokenizer: ``--gguf-pre`` names the pre-tokenizer it writes for a
            tokenizer it does not recognise (GGUF).
        writes_adapters: SRC may be a PEFT LoRA adapter folder (``plan_adapter``).
        takes_config: its folders may lack a model config, given apart (``--config``, passed to
            ``open``); other formats carry their own and refuse it.
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
    takes_pre_tokenizer: bool = False
    writes_adapters: bool = False
    takes_config: bool = False
    aliases: tuple[str, ...] = ()
    lone_file: re.Pattern[str] | None = None
    torchtune_checkpointers: tuple[str, ...] = ()
    holds_quantized: bool = False


@dataclass(frozen=True)
class Support:
    """What a format does with a family's checkpoints (the support matrix, ``ckptkit support``).

    Attributes:
        reads / writes: whether it reads / writes checkpoints of the family.
        tokenizer: what a conversion into it does with the tokenizer.
        needs: what a checkpoint must have to be written, by topic (a conversion that lacks
            one is refused in one line saying so).
    """

    reads: bool
    writes: bool
    tokenizer: str = "carried"
    needs: dict[str, str] = field(default_factory=dict)


class CheckpointFormat:
    """One on-disk format: a reading part (find, open and understand a checkpoint) and a
    writing part (lay a checkpoint out, then write what lies beside its weights).

    Attributes:
        name: what ``--to`` / ``--from`` accept and ``inspect`` prints.
        info: its files and the options it takes (:class:`FormatInfo`).
        planner: how :meth:`plan` lays a folder of this format out, and which writer writes
            each of its files: a :class:`ckptkit.formats.planning.FolderPlanner` subclass,
            made with the format.
        records: how its checkpoints record layouts (:class:`ckptkit.formats.records.LayoutRecord`):
            the origin sidecar and their own layout, by default.
    """

    name: ClassVar[str]
    info: FormatInfo
    planner: ClassVar[type[FolderPlanner]] = FolderPlanner
    records: ClassVar[LayoutRecord] = LayoutRecord()

    # --- reading --------------------------------------------------------------------
    def detect(self, root: Path) -> bool:
        """Whether directory ``root`` holds this format (file names only, nothing read): by
        default, whether it holds ``info.config_file`` and a file ``info.weight_file`` matches."""
        config = self.info.config_file
        has_weights = any(self.info.weight_file.fullmatch(p.name) for p in entries(root))
        return config is not None and is_file(root / config) and has_weights

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        """The raw view: config text, files and tensor metadata; tensors stay unread.
        ``config``: the model config given apart (``--config``), only ever passed to a format
        whose ``info.takes_config`` says its folders may lack one (DCP)."""
        raise NotImplementedError

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        """The model family and config the metadata describes; ``family`` given
        (``--model-type``), the config read as that family's. An error asking for
        ``--model-type`` when the family is unsure (:class:`ckptkit.errors.UnknownModel`)."""
        raise NotImplementedError

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        """The family's native tensor names and transforms in this format."""
        raise NotImplementedError

    def canonical_view(
        self, raw: RawCheckpoint, family: Family, cfg: ModelConfig
    ) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
        """(canonical tensors, native tensors the model does not use), lazily."""
        from ckptkit.formats.canonical import canonical_view

        return canonical_view(raw, self.layout(family, cfg), cfg)

    def describe(self, raw: RawCheckpoint, info: dict[str, Any]) -> dict[str, Any]:
        """What ``inspect`` prints of an opened checkpoint: ``info`` as built from the tensor
        infos by default; a format may add its own metadata or stored types."""
        return info

    def support(self, family: Family) -> Support:
        """Whether it reads and writes checkpoints of ``family``, and what it does with their
        tokenizer: by default, both when the family has a layout in this format (asked with
        a small probe config), the tokenizer files carried as they are."""
        from ckptkit.models.config import ModelConfig

        probe = ModelConfig(family.name, 32, 16, 1, 2, 2, 8, 32, extra=family.fields())
        try:
            self.layout(family, probe)
        except CkptkitError:
            return Support(False, False, "-")
        return Support(True, True)

    # --- writing --------------------------------------------------------------------
    def plan(self, ckpt: OpenedCheckpoint, opts: Options) -> Plan:
        """How ``ckpt`` is laid out in this format: every tensor to write, its file, order,
        ranks and writer, and the metadata files; by default as :attr:`planner` plans a
        folder (the recorded layout restored, else laid out afresh)."""
        return self.planner(self).plan(ckpt, opts)

    def plan_adapter(self, adapter: Path, base: OpenedCheckpoint, opts: Options) -> Plan:
        """For a format that holds LoRA adapters (``info.writes_adapters``): the plan of the PEFT
        adapter folder ``adapter``, trained on the checkpoint ``base``."""
        raise NotImplementedError

    def finish(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        """Write the files beside the weights: the plan's metadata files, the source's
        layout (:attr:`records`, so that converting back restores it exactly), and the
        source's other files (tokenizer, generation config) as the plan's tokenizer says."""
        for name, text in plan.metadata_files.items():
            (out_dir / name).write_text(text, encoding="utf-8")
        self.records.write(ckpt, plan, out_dir)
        for extra in ckpt.extra_files():
            if extra.name not in plan.tokenizer.skip:
                copy_file(extra, out_dir / extra.name)
        for name, data in plan.tokenizer.files.items():
            (out_dir / name).write_bytes(data)


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
