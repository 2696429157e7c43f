"""Meta's layout: ``consolidated.00.pth`` ... ``consolidated.NN.pth`` (one per
model-parallel rank) + ``params.json``; Mistral's ``consolidated.safetensors`` and
torchtune's single-file output (:mod:`ckptkit.formats.torchtune`) read the same.

Ranks are merged on read: column-parallel tensors on dim 0, row-parallel on dim 1,
``tok_embeddings`` on whichever dim its shard shape shows, the rest replicated.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import (
    FilePlan,
    OpenedCheckpoint,
    Options,
    Plan,
    RawCheckpoint,
    natural_key,
    read_config,
)
from ckptkit.formats.containers import TensorFile, open_tensor_file
from ckptkit.formats.format import CheckpointFormat, FormatInfo, Support
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.registry import holds_hf_files, register
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.formats.torchtune import SINGLE_FILE as TORCHTUNE_FILE
from ckptkit.formats.torchtune import torchtune_files
from ckptkit.io import entries, is_file
from ckptkit.tokenization import TokenizerPlan, tokenizer_for_meta

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.lazy import Lazy

RANK_FILE = re.compile(r"consolidated\.(\d{2})\.pth")
SAFETENSORS_FILE = "consolidated.safetensors"
TIE_SAMPLE_BYTES = 4096
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


def rank_file(rank: int) -> str:
    return f"consolidated.{rank:02d}.pth"


def split_dim(name: str, ndim: int, vocab_parallel: bool) -> int | None:
    """The dim Meta's model-parallel ranks split tensor ``name`` on (None: replicated)."""
    stem = name.removesuffix(".weight")
    if ndim < 2:
        return None
    if stem == "tok_embeddings":
        return 0 if vocab_parallel else 1
    if stem.endswith(COLUMN_PARALLEL):
        return 0
    if stem.endswith(ROW_PARALLEL):
        return 1
    return None


def rank_files(root: Path) -> list[Path]:
    """Meta's own naming: ``consolidated.NN.pth``, one per model-parallel rank."""
    return sorted((p for p in entries(root) if RANK_FILE.fullmatch(p.name)), key=lambda p: natural_key(p.name))


def mistral_file(root: Path) -> list[Path]:
    """Mistral's releases: one ``consolidated.safetensors``."""
    single = root / SAFETENSORS_FILE
    return [single] if is_file(single) else []


# The file namings Meta-layout weights come in, tried in order; the first that finds files wins.
NAMINGS = (rank_files, mistral_file, torchtune_files)
WEIGHT_FILE = re.compile(
    "|".join(f"(?:{n})" for n in (RANK_FILE.pattern, re.escape(SAFETENSORS_FILE), TORCHTUNE_FILE.pattern))
)


def weight_files(root: Path) -> list[Path]:
    for naming in NAMINGS:
        found = naming(root)
        if found:
            return found
    return []


def detect(root: Path) -> bool:
    return is_file(root / "params.json") and bool(weight_files(root))


def open_raw(root: Path) -> RawCheckpoint:
    config_text, params = read_config(root / "params.json")
    paths = weight_files(root)
    ranks = [int(m.group(1)) for p in paths if (m := RANK_FILE.fullmatch(p.name))]
    gaps = [r for r in range(max(ranks, default=-1) + 1) if r not in ranks]
    if gaps:
        raise CkptkitError(
            f"{root / rank_file(gaps[0])}: missing: the rank files go up to {rank_file(max(ranks))}, "
            f"so the checkpoint has {max(ranks) + 1} model-parallel ranks; copy every rank file"
        )
    readers: dict[str, TensorFile] = {}
    files: dict[str, list[str]] = {}
    for p in paths:
        reader = open_tensor_file(p)
        readers[p.name], files[p.name] = reader, list(reader.infos)
    first = paths[0].name
    for name, keys in files.items():
        if set(keys) != set(files[first]):
            odd = sorted(set(keys) ^ set(files[first]))[:3]
            raise CkptkitError(f"{root / name}: holds different tensors than {first} ({', '.join(odd)})")
    infos: dict[str, TensorInfo] = {}
    split_dims: dict[str, int | None] = {}
    n = len(paths)
    dim = int(params.get("dim", 0))
    for key in files[first]:
        shards = [readers[f].infos[key] for f in files]
        shape = shards[0].shape
        if any(s.shape != shape or s.dtype != shards[0].dtype for s in shards):
            raise CkptkitError(f"{root}: tensor {key!r} has different shapes or dtypes across ranks")
        d = None
        if n > 1:
            # tok_embeddings: Llama 2 splits the hidden dim, Llama 3 the vocabulary.
            d = split_dim(key, len(shape), vocab_parallel=len(shape) == 2 and shape[1] == dim)
            if d is not None:
                shape = tuple(s * n if i == d else s for i, s in enumerate(shape))
        split_dims[key] = d
        infos[key] = TensorInfo(key, shape, shards[0].dtype, first)
    if ranks:
        check_rank_count(root, params, infos, len(ranks))
    return RawCheckpoint(
        format="meta",
        root=root,
        files=files,
        infos=infos,
        readers=dict(readers),
        config_name="params.json",
        config_text=config_text,
        config=params,
        file_metadata={f: r.metadata for f, r in readers.items()},
        split_dims=split_dims if n > 1 else {},
    )


def check_rank_count(root: Path, params: dict[str, Any], infos: dict[str, TensorInfo], n: int) -> None:
    """A one-line error naming the first missing rank file when the rank files found hold
    a fraction of the query projection params.json describes (``n_heads`` x ``head_dim`` rows)."""
    wq = infos.get("layers.0.attention.wq.weight")
    try:
        n_heads = int(params["n_heads"])
        rows = n_heads * int(params.get("head_dim") or int(params["dim"]) // n_heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # the family's config check names the field
    per_rank = wq.shape[0] // n if wq is not None and wq.shape else 0
    if per_rank == 0 or wq is None or wq.shape[0] >= rows or rows % per_rank:
        return
    held = f"{n} rank files hold" if n > 1 else f"{rank_file(0)} holds"
    raise CkptkitError(
        f"{root / rank_file(n)}: missing: params.json's n_heads x head_dim give {rows} rows of "
        f"layers.0.attention.wq.weight, {held} {wq.shape[0]}, so the checkpoint has {rows // per_rank} "
        "model-parallel ranks; copy every rank file"
    )


class MetaPlanner(FolderPlanner):
    """Meta's ranks (``--shards N``) or Mistral's one safetensors file, params.json, tokenizer.model."""

    fmt: MetaFormat

    def extra_tensors(self, family: Family, cfg: ModelConfig) -> dict[str, Lazy]:
        return family.meta_extra_tensors(cfg)

    def split_dim(self, name: str, ndim: int, family: Family) -> int | None:
        return split_dim(name, ndim, family.vocab_parallel)

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        from ckptkit.formats.safetensors_io import library_order

        n = opts.shards or 1
        if n == 1 and ckpt.family.meta_container == "safetensors":
            order = library_order([(k, t.dtype, t.shape) for k, t in targets.items()])
            return [FilePlan(SAFETENSORS_FILE, order, None)], {}
        files = [FilePlan(rank_file(r), list(targets), rank=r, ranks=n) for r in range(n)]
        split: dict[str, int | None] = {}
        if n > 1:
            for k, t in targets.items():
                d = split_dim(k, len(t.shape), ckpt.family.vocab_parallel)
                if d is not None and t.shape[d] % n:
                    raise CkptkitError(
                        f"--shards {n}: {k} has {t.shape[d]} rows/columns on dim {d}, not divisible by {n}"
                    )
                split[k] = d
        return files, split

    def tokenizer(self, ckpt: OpenedCheckpoint) -> TokenizerPlan:
        return tokenizer_for_meta(ckpt.side_folder, ckpt.family.tokenizer, holds_hf_files(ckpt))

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        recorded = (ckpt.origin.get("config") or {}) if plan.restored else {}
        if recorded.get("name") == "params.json":
            if "quantization" not in json.loads(recorded["text"]):
                return {"params.json": recorded["text"]}
            doc = json.loads(recorded["text"])  # Mistral's FP8 release, written dequantized
            del doc["quantization"]
            return {"params.json": json.dumps(doc) + "\n"}
        return {"params.json": json.dumps(ckpt.family.config_to_meta(ckpt.config)) + "\n"}


class MetaFormat(CheckpointFormat):
    """Meta's ``consolidated.NN.pth`` ranks (or Mistral's ``consolidated.safetensors``) + ``params.json``."""

    planner = MetaPlanner

    name = "meta"
    info = FormatInfo(
        expects="params.json + consolidated.*.pth",
        weight_file=WEIGHT_FILE,
        detect_order=20,
        config_file="params.json",
        metadata_names=("params.json",),
        layer_field="n_layers",
        sharding="ranks",
        aliases=("llama", "consolidated"),
        lone_file=re.compile(rf"(?s:consolidated\..*)|(?:{TORCHTUNE_FILE.pattern})"),
        torchtune_checkpointers=("torchtune.training.FullModelMetaCheckpointer",),
    )

    def detect(self, root: Path) -> bool:
        return detect(root)

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        if not detect(root):
            raise CkptkitError(f"{root}: not a Meta checkpoint (needs params.json and consolidated.*.pth)")
        return open_raw(root)

    def _source(self, raw: RawCheckpoint) -> Any:
        from ckptkit.models import MetaSource

        return MetaSource(
            raw.config,
            {k: i.shape for k, i in raw.infos.items()},
            "safetensors" if SAFETENSORS_FILE in raw.files else "pth",
            lambda: _output_repeats_embeddings(raw),
        )

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        from ckptkit.models import detect_from_meta

        source = self._source(raw)
        family = family or detect_from_meta(source, str(raw.root / raw.config_name))
        try:
            return family, family.config_from_meta(source)
        except CkptkitError as e:
            raise CkptkitError(f"{raw.root / raw.config_name}: {e}") from None

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        return family.meta_layout(cfg)

    def support(self, family: Family) -> Support:
        spec = family.tokenizer
        return dataclasses.replace(super().support(family), tokenizer=f"tokenizer.model ({spec.kind})" if spec else "-")


def _output_repeats_embeddings(raw: RawCheckpoint) -> bool:
    """Whether output.weight has the embeddings' shape and dtype and starts with the same bytes."""
    emb, out = raw.infos.get("tok_embeddings.weight"), raw.infos.get("output.weight")
    if emb is None or out is None or emb.shape != out.shape or emb.dtype != out.dtype:
        return False
    reader = raw.readers[next(iter(raw.files))]
    return reader.sample("tok_embeddings.weight", TIE_SAMPLE_BYTES) == reader.sample("output.weight", TIE_SAMPLE_BYTES)


register(MetaFormat())
