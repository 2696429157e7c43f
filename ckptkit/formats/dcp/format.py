"""The DCP formats: ``dcp`` (Meta's tensor names, as torch's ``dcp.load`` users and
torchtitan before April 2026 read them) and ``dcp-titan`` (torchtitan's 2026 spelling,
``attention.qkv_linear.wq`` and ``lm_head``): one class, two registered objects. Either
reads both spellings; detection picks the one a folder is spelled in, and each writes its own.
Q/K are in Meta's layout in both. Detection, opening, the family and config a DCP folder
describes, its fresh file layout and writer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import FilePlan, OpenedCheckpoint, Options, Plan, RawCheckpoint
from ckptkit.formats.dcp.folder import (
    DISTCP,
    checkpoint_folder,
    open_dcp,
    spelled_2026,
    titan_name,
)
from ckptkit.formats.dcp.metadata import METADATA
from ckptkit.formats.dcp.reading import DcpCheckpoint
from ckptkit.formats.dcp.writing import DistcpWriter, metadata_bytes, rank_file
from ckptkit.formats.format import CheckpointFormat, FormatInfo
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.records import LayoutRecord
from ckptkit.formats.registry import register
from ckptkit.formats.writers import TensorWriter
from ckptkit.quant import FP8_DTYPE, QUANT_KEY

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout, Rule
    from ckptkit.tensors.lazy import Lazy

TIE_SAMPLE_BYTES = 4096


class DcpPlanner(FolderPlanner):
    """DCP ranks (``--shards N``, dim 0 split where it divides), params.json; torchtitan's names for titan."""

    fmt: DcpFormat

    def write_layout(self, ckpt: OpenedCheckpoint) -> Layout:
        own = ckpt.family.dcp_layout(ckpt.config, self.fmt.titan)
        if own is not None:
            return own
        layout = super().write_layout(ckpt)
        if not self.fmt.titan:
            return layout

        def renamed(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
            return tuple(dataclasses.replace(r, native=titan_name(r.native)) for r in rules)

        return dataclasses.replace(
            layout, head=renamed(layout.head), layer=renamed(layout.layer), tail=renamed(layout.tail)
        )

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        n = opts.shards or 1
        split: dict[str, int | None] = {}
        for k, t in targets.items():
            split[k] = 0 if n > 1 and t.shape and t.shape[0] % n == 0 and t.shape[0] >= n else None
        files = [
            FilePlan(rank_file(r), [k for k in targets if r == 0 or split[k] is not None], rank=r, ranks=n)
            for r in range(n)
        ]
        return files, split if n > 1 else {}

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        weights = list(plan.targets.values())
        dtype = max(weights, key=lambda t: t.nbytes).dtype if weights else "float32"
        name, config = ckpt.family.dcp_config(ckpt.config, dtype)
        if plan.quant_config is not None:  # read back from here (DCP's .metadata has no place for it)
            config[QUANT_KEY] = plan.quant_config
        return {name: json.dumps(config) + "\n"}

    def writer(self, path: Path, plan: Plan, file: FilePlan, direct: bool) -> TensorWriter:
        return DistcpWriter(path, plan.entries(file), direct)


class DcpFormat(CheckpointFormat):
    """``.metadata`` + ``__R_N.distcp`` (``step-N`` folders allowed), model tensors named in
    Meta's spelling or (``titan``) torchtitan's 2026 one."""

    planner = DcpPlanner
    records = LayoutRecord(restores=False)  # ranks and chunks are not restored: laid out afresh

    def __init__(self, name: str, titan: bool, aliases: tuple[str, ...]) -> None:
        self.name = name  # type: ignore[misc]
        self.titan = titan
        self.info = FormatInfo(
            expects=".metadata + __R_N.distcp (PyTorch DCP)",
            weight_file=DISTCP,
            detect_order=15,
            metadata_names=(METADATA,),
            layer_field="n_layers",
            sharding="ranks",
            takes_config=True,
            aliases=aliases,
            holds_quantized=True,
            extra_dtypes=(FP8_DTYPE,),
        )

    def detect(self, root: Path) -> bool:
        return checkpoint_folder(root) is not None and spelled_2026(root) == self.titan

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        return open_dcp(root, config, self.name)

    def _source(self, raw: RawCheckpoint) -> Any:
        from ckptkit.models import MetaSource

        return MetaSource(
            raw.config, {k: i.shape for k, i in raw.infos.items()}, "pth", lambda: _output_repeats_embeddings(raw)
        )

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        from ckptkit.models import detect_from_hf, detect_from_meta

        where = str(raw.root / raw.config_name)
        hf, source = raw.hf_config, self._source(raw)
        family = family or (detect_from_hf(raw.config, where) if hf else detect_from_meta(source, where))
        try:
            return family, family.config_from_hf(raw.config) if hf else family.config_from_meta(source)
        except CkptkitError as e:
            raise CkptkitError(f"{where}: {e}") from None

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        own = family.dcp_layout(cfg, titan=False)  # as read: opening names tensors in Meta's spelling
        return own if own is not None else family.meta_layout(cfg)

    def finish(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        (out_dir / METADATA).write_bytes(metadata_bytes(plan))
        super().finish(ckpt, plan, out_dir)


def _output_repeats_embeddings(raw: RawCheckpoint) -> bool:
    emb, out = raw.infos.get("tok_embeddings.weight"), raw.infos.get("output.weight")
    if emb is None or out is None or emb.shape != out.shape or emb.dtype != out.dtype:
        return False
    sample = _dcp(raw).sample
    return bool(sample("tok_embeddings.weight", TIE_SAMPLE_BYTES) == sample("output.weight", TIE_SAMPLE_BYTES))


def _dcp(raw: RawCheckpoint) -> DcpCheckpoint:
    if not isinstance(raw, DcpCheckpoint):  # pragma: no cover - the format opens its own
        raise TypeError(f"{raw.root}: not opened by a dcp format")
    return raw


register(DcpFormat("dcp", False, ("dcp-meta", "distcp", "torch-dcp")))
register(DcpFormat("dcp-titan", True, ("torchtitan", "titan", "dcp-torchtitan", "dcp-2026")))
