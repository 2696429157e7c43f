"""ckptkit's own layout: canonical tensor names in safetensors plus ``ckptkit.json``,
which holds the model config and the origin layout so converting back is exact."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base import (
    INTERNAL_FILE,
    FilePlan,
    OpenedCheckpoint,
    Options,
    Plan,
    RawCheckpoint,
    TensorReader,
    read_json,
)
from ckptkit.formats.format import CheckpointFormat, FormatInfo, Support, size_sharded_files
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.records import LayoutRecord
from ckptkit.formats.registry import find_format, register
from ckptkit.formats.safetensors_io import SafetensorsReader
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import is_file
from ckptkit.models.fields import check_config_fields
from ckptkit.quant import FP8_DTYPE, QUANT_KEY
from ckptkit.tensors.transforms import COPY
from ckptkit.untrusted import plain_name

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.tensors.lazy import Lazy
    from ckptkit.tensors.transforms import Transform

UNUSED_PREFIX = "_unused."  # tensors the model does not use, under their origin names
SINGLE = "weights.safetensors"
PATTERN = "weights{suffix}.safetensors"
VERSION = 1
FILE_NAME = re.compile(r"weights(-\d{5}-of-\d{5})?\.safetensors")

# The config of ckptkit.json (version 1): every key in this order, a field the model type does
# not have written as it was when all families shared one config (_V1_ABSENT); a family's own
# fields not listed here follow them.
_V1_ORDER = (
    "model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "hidden_act", "norm_plus_one", "embed_scale", "bos_token_id", "eos_token_id", "pad_token_id",
    "sliding_window", "use_sliding_window", "max_window_layers", "partial_rotary_factor",
    "original_max_position_embeddings", "resid_pdrop", "embd_pdrop", "multiple_of", "ffn_dim_multiplier",
    "input_norms", "post_norms", "qk_norm", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "layer_types", "local_rope_theta", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef", "dense_layers", "experts_layout",
)  # fmt: skip
_V1_ABSENT: dict[str, Any] = {
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": None, "partial_rotary_factor": 1.0,
    "original_max_position_embeddings": None, "resid_pdrop": None, "embd_pdrop": None, "multiple_of": None,
    "ffn_dim_multiplier": None, "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "layer_types": None, "local_rope_theta": None, "num_experts": 0,
    "num_experts_per_tok": 0, "moe_intermediate_size": None, "norm_topk_prob": True, "router_aux_loss_coef": 0.0,
    "dense_layers": None, "experts_layout": "per-expert",
}  # fmt: skip


def config_doc(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config`` of ckptkit.json for ``cfg`` (its keys in version 1's order)."""
    fields = cfg.to_dict()
    out = {k: fields.pop(k) if k in fields else _V1_ABSENT[k] for k in _V1_ORDER}
    return out | fields


def detect(root: Path) -> bool:
    return is_file(root / INTERNAL_FILE)


def open_raw(root: Path) -> RawCheckpoint:
    text, doc = read_json(root / INTERNAL_FILE)
    if doc.get("format") != "internal" or doc.get("version") != VERSION:
        raise CkptkitError(f"{root / INTERNAL_FILE}: not a ckptkit internal checkpoint (version {VERSION})")
    if not isinstance(doc.get("config"), dict):
        raise CkptkitError(f"{root / INTERNAL_FILE}: invalid config (not a JSON object)")
    check_config_fields(INTERNAL_FILE, doc["config"], root / INTERNAL_FILE)
    files: dict[str, list[str]] = {}
    readers: dict[str, TensorReader] = {}
    infos: dict[str, TensorInfo] = {}
    listed = doc.get("files")
    if not isinstance(listed, dict) or not all(
        isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in listed.values()
    ):
        raise CkptkitError(f"{root / INTERNAL_FILE}: invalid 'files' (expected file name -> list of tensor names)")
    for name, keys in listed.items():
        path = root / plain_name(name, root / INTERNAL_FILE, FILE_NAME, "weight file name")
        if not is_file(path):
            raise CkptkitError(f"{root / INTERNAL_FILE}: names weight file {name}, which does not exist")
        reader: Any = SafetensorsReader(path)
        if set(reader.infos) != set(keys):
            raise CkptkitError(f"{path}: does not hold the tensors {INTERNAL_FILE} lists for it")
        readers[name], files[name] = reader, list(reader.infos)
        infos.update(reader.infos)
    return RawCheckpoint(
        format="internal",
        root=root,
        files=files,
        infos=infos,
        readers=readers,
        config_name=INTERNAL_FILE,
        config_text=text,
        config=doc,
        file_metadata={f: r.metadata for f, r in readers.items()},  # type: ignore[attr-defined]
    )


class InternalPlanner(FolderPlanner):
    """Canonical names as they are, unused tensors under a prefix, shards of ``--max-shard-size``."""

    fmt: InternalFormat

    def keeps_hf_files(self, origin: dict[str, Any]) -> bool:
        """Made from an HF layout (not by way of Meta, which keeps those files only in its record)."""
        source = find_format(origin.get("format"))
        return (
            source is not None
            and source is not self.fmt
            and source.planner(source).keeps_hf_files({})
            and not origin.get("tokenizer")
        )

    def targets(
        self, ckpt: OpenedCheckpoint, pool: dict[str, Lazy], with_optional: bool
    ) -> tuple[dict[str, Lazy], list[str]]:
        targets = dict(ckpt.tensors)
        targets.update({UNUSED_PREFIX + k: v for k, v in ckpt.unused.items()})
        return targets, []

    def required(self, ckpt: OpenedCheckpoint) -> set[str]:
        return set(ckpt.tensors)

    def rules(self, ckpt: OpenedCheckpoint) -> list[tuple[str, tuple[str, ...], Transform]]:
        return [(k, (k,), COPY) for k in ckpt.tensors]

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        return size_sharded_files(targets, opts, PATTERN, SINGLE, safetensors=True), {}


class InternalRecord(LayoutRecord):
    """The origin layout kept in ``ckptkit.json``, with the config and the files."""

    def read(self, raw: RawCheckpoint) -> tuple[Any, Path] | None:
        return raw.config.get("origin") or {}, raw.root / INTERNAL_FILE

    def own(self, ckpt: OpenedCheckpoint) -> dict[str, Any]:
        return ckpt.recorded_origin or {}  # canonical names: the origin is what it keeps

    def write(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        doc = {
            "format": plan.format,
            "version": VERSION,
            "model_type": ckpt.family.name,
            "config": config_doc(ckpt.config),
            "files": {f.name: f.keys for f in plan.files},
            "origin": ckpt.origin,
        }
        if plan.quant_config is not None:
            doc[QUANT_KEY] = plan.quant_config
        (out_dir / INTERNAL_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


class InternalFormat(CheckpointFormat):
    """Canonical names in safetensors + ``ckptkit.json`` (config and the origin layout)."""

    name = "internal"
    info = FormatInfo(
        expects="ckptkit.json",
        weight_file=FILE_NAME,
        detect_order=10,
        metadata_names=(INTERNAL_FILE,),
        layer_field="config.num_layers",
        sharding="size",
        holds_quantized=True,
        extra_dtypes=(FP8_DTYPE,),
    )
    planner = InternalPlanner
    records = InternalRecord()

    def detect(self, root: Path) -> bool:
        return detect(root)

    def support(self, family: Family) -> Support:
        return Support(True, True)  # canonical names: every family

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        return open_raw(root)

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        from ckptkit.models import ModelConfig, get_family

        try:
            family = family or get_family(raw.config["config"]["model_type"])
            return family, ModelConfig.from_dict(raw.config["config"], family.fields)
        except (KeyError, TypeError) as e:
            raise CkptkitError(f"{raw.root / INTERNAL_FILE}: invalid config ({e})") from None

    def canonical_view(
        self, raw: RawCheckpoint, family: Family, cfg: ModelConfig
    ) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
        from ckptkit.models import canonical_shapes
        from ckptkit.tensors.lazy import Lazy

        root = raw.root
        tensors: dict[str, Lazy] = {}
        unused: dict[str, Lazy] = {}
        for key, info in raw.infos.items():
            lazy = Lazy(
                info.shape, info.dtype, functools.partial(raw.read, key), info.file, functools.partial(raw.spans, key)
            )
            if key.startswith(UNUSED_PREFIX):
                unused[key.removeprefix(UNUSED_PREFIX)] = lazy
            else:
                tensors[key] = lazy
        expected = canonical_shapes(cfg)
        odd = [k for k in tensors if k not in expected]
        if odd:
            raise CkptkitError(f"{root / tensors[odd[0]].file}: unknown tensor name(s): {', '.join(odd[:3])}")
        for name, shape in expected.items():
            if name not in tensors:
                raise CkptkitError(f"{root}: tensor {name!r} is missing")
            if tensors[name].shape != shape:
                raise CkptkitError(f"{root / tensors[name].file}: the config contradicts the tensor shapes: {name}")
        return {k: tensors[k] for k in expected}, unused


register(InternalFormat())
