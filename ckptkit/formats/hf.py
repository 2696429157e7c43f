"""Hugging Face layouts: ``config.json`` plus ``model*.safetensors`` (``hf``) or
``pytorch_model*.bin`` (``hf-bin``), single file or shards with an ``*.index.json``."""

from __future__ import annotations

import dataclasses
import json
import math
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
    TensorReader,
    natural_key,
    read_config,
    read_json,
)
from ckptkit.formats.containers import is_safetensors, open_tensor_file
from ckptkit.formats.format import CheckpointFormat, FormatInfo, Support, size_sharded_files
from ckptkit.formats.planning import FolderPlanner
from ckptkit.formats.registry import holds_hf_files, register
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import entries, is_file
from ckptkit.quant import FP8_DTYPE, QUANT_KEY
from ckptkit.tensors.dtypes import FLOATING
from ckptkit.tokenization import TokenizerPlan, tokenizer_for_hf
from ckptkit.untrusted import plain_name

if TYPE_CHECKING:
    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.lazy import Lazy


def open_raw(root: Path, fmt: HFFormat) -> RawCheckpoint:
    config_text, config = read_config(root / "config.json")
    index_path = root / fmt.index_name
    index = None
    if is_file(index_path):
        text, data = read_json(index_path)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CkptkitError(f"{index_path}: has no weight_map")
        for shard in weight_map.values():
            plain_name(shard, index_path, fmt.info.weight_file, "shard name")
        names = sorted(set(weight_map.values()), key=natural_key)
        for name in names:
            if not is_file(root / name):
                raise CkptkitError(f"{index_path}: names shard {name}, which does not exist")
        index = {"name": index_path.name, "text": text}
    else:
        found = fmt.weight_files(root)
        if len(found) != 1 or found[0].name != fmt.single_name:
            raise CkptkitError(
                f"{root}: found {len(found)} weight files ({', '.join(p.name for p in found[:3])}) "
                f"but no {index_path.name} saying which tensor is where"
            )
        names, weight_map = [found[0].name], None
    readers: dict[str, TensorReader] = {}
    files: dict[str, list[str]] = {}
    infos: dict[str, TensorInfo] = {}
    file_metadata: dict[str, dict[str, str] | None] = {}
    file_aliases: dict[str, dict[str, str]] = {}
    for name in names:
        reader = open_tensor_file(root / name)
        readers[name] = reader
        files[name] = list(reader.infos)
        file_metadata[name] = reader.metadata
        if reader.aliases:
            file_aliases[name] = reader.aliases
        for key, info in reader.infos.items():
            if key in infos:
                raise CkptkitError(f"{root / name}: tensor {key!r} is also in {infos[key].file}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CkptkitError(
                    f"{index_path}: does not list tensor {key!r}, which {name} holds"
                    if key not in weight_map
                    else f"{index_path}: says {key!r} is in {weight_map[key]} but {name} holds it"
                )
            infos[key] = info
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in infos:
                raise CkptkitError(f"{index_path}: says {key!r} is in {name}, but {name} does not hold it")
    return RawCheckpoint(
        format=fmt.name,
        root=root,
        files=files,
        infos=infos,
        readers=readers,
        config_name="config.json",
        config_text=config_text,
        config=config,
        index=index,
        file_metadata=file_metadata,
        file_aliases=file_aliases,
        hf_config=True,
    )


def index_text(weight_map: dict[str, str], total_size: int, total_parameters: int | None) -> str:
    """An index file as transformers writes it (sorted keys, two-space indent)."""
    metadata: dict[str, int] = {"total_size": total_size}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    return json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"


class HFPlanner(FolderPlanner):
    """An HF folder: shards of ``--max-shard-size`` and their index, config.json, tokenizer files."""

    fmt: HFFormat

    def default_files(
        self, ckpt: OpenedCheckpoint, targets: dict[str, Lazy], opts: Options
    ) -> tuple[list[FilePlan], dict[str, int | None]]:
        files = size_sharded_files(targets, opts, self.fmt.shard_pattern, self.fmt.single_name, self.fmt.safetensors)
        return files, {}

    def keeps_hf_files(self, origin: dict[str, Any]) -> bool:
        return True

    def tokenizer(self, ckpt: OpenedCheckpoint) -> TokenizerPlan:
        cfg = ckpt.config
        recorded, from_hf = ckpt.origin.get("tokenizer"), holds_hf_files(ckpt)
        spec = ckpt.family.tokenizer
        return tokenizer_for_hf(ckpt.side_folder, spec, cfg.vocab_size, cfg.max_position_embeddings, recorded, from_hf)

    def metadata_files(self, ckpt: OpenedCheckpoint, plan: Plan, cast: str | None) -> dict[str, str]:
        out: dict[str, str] = {}
        weights = list(plan.targets.values())
        main_dtype = max(weights, key=lambda t: t.nbytes).dtype if weights else "float32"
        recorded = (ckpt.origin.get("config") or {}) if plan.restored else {}
        if recorded.get("name") == self.fmt.info.config_file:
            text = recorded["text"]
            doc = json.loads(text)
            if cast is not None or doc.get(QUANT_KEY) != plan.quant_config:
                for key in ("dtype", "torch_dtype"):
                    if key in doc and cast is not None:
                        doc[key] = main_dtype
                _set_quant_config(doc, plan.quant_config)
                text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
            out["config.json"] = text
        else:
            ids = {k: v for k, v in plan.tokenizer.ids.items() if getattr(ckpt.config, k) is None}
            if plan.quant_config is not None:  # the dtype of what is not quantized
                main_dtype = max(
                    (t for k, t in plan.targets.items() if t.dtype in FLOATING and "float8" not in t.dtype),
                    key=lambda t: t.nbytes,
                ).dtype
            config = ckpt.family.config_to_hf(dataclasses.replace(ckpt.config, **ids), main_dtype)
            _set_quant_config(config, plan.quant_config)
            out["config.json"] = json.dumps(config, indent=2, sort_keys=True) + "\n"
        index = ckpt.origin.get("index") if plan.restored else None
        if len(plan.files) > 1 or index:  # a single shard keeps the index it came with
            written = {k for f in plan.files for k in f.keys}
            if index and cast is None and set(json.loads(index["text"]).get("weight_map", {})) == written:
                out[index["name"]] = index["text"]
            else:
                weight_map = {k: f.name for f in plan.files for k in f.keys}
                total = sum(plan.targets[k].nbytes for k in weight_map)
                params = sum(math.prod(plan.targets[k].shape) for k in weight_map) if self.fmt.safetensors else None
                out[self.fmt.index_name] = index_text(dict(sorted(weight_map.items())), total, params)
        return out


def _set_quant_config(doc: dict[str, Any], quant_config: dict[str, Any] | None) -> None:
    """``doc``'s ``quantization_config``: the one of the weights written, or none."""
    if quant_config is None:
        doc.pop(QUANT_KEY, None)
    else:
        doc[QUANT_KEY] = quant_config


class HFFormat(CheckpointFormat):
    """``config.json`` + ``{stem}{ext}`` or its shards with an index, as transformers saves them."""

    planner = HFPlanner
    index_name: str

    def __init__(self, name: str, stem: str, ext: str, aliases: tuple[str, ...]) -> None:
        self.name = name  # type: ignore[misc]
        self.stem, self.ext = stem, ext
        self.safetensors = is_safetensors(ext)
        self.single_name = stem + ext
        self.index_name = f"{stem}{ext}.index.json"
        self.shard_pattern = stem + "{suffix}" + ext  # huggingface_hub's filename pattern
        self.info = FormatInfo(
            expects="config.json + model*.safetensors or pytorch_model*.bin",
            weight_file=re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}"),
            detect_order=30,
            config_file="config.json",
            index_name=self.index_name,
            metadata_names=("config.json",),
            layer_field="num_hidden_layers",
            loads_in_transformers=True,
            sharding="size",
            aliases=aliases,
            lone_file=re.compile(rf"{re.escape(stem)}(?s:.*){re.escape(ext)}(?:\.index\.json)?"),
            torchtune_checkpointers=("torchtune.training.FullModelHFCheckpointer",),
            holds_quantized=True,
            extra_dtypes=(FP8_DTYPE,),
        )

    def weight_files(self, root: Path) -> list[Path]:
        found = (p for p in entries(root) if self.info.weight_file.fullmatch(p.name))
        return sorted(found, key=lambda p: natural_key(p.name))

    def detect(self, root: Path) -> bool:
        has_weights = bool(self.weight_files(root)) or is_file(root / self.index_name)
        return is_file(root / "config.json") and has_weights

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        if not self.detect(root):
            raise CkptkitError(
                f"{root}: not an {self.name} checkpoint (needs config.json and {self.single_name} or shards)"
            )
        return open_raw(root, self)

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        from ckptkit.models import detect_from_hf

        family = family or detect_from_hf(raw.config, str(raw.root / raw.config_name))
        try:
            return family, family.config_from_hf(raw.config)
        except (KeyError, TypeError, ValueError) as e:
            raise CkptkitError(f"{raw.root / raw.config_name}: missing or invalid field {e}") from None

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        return family.hf_layout(cfg)

    def support(self, family: Family) -> Support:
        found = super().support(family)
        if family.tokenizer is None:
            return found
        return dataclasses.replace(found, tokenizer="tokenizer.json (from a Meta tokenizer.model)")


HF_ALIASES = ("huggingface", "hugging-face", "transformers", "safetensors", "hf-safetensors")
register(HFFormat("hf", "model", ".safetensors", HF_ALIASES))
register(HFFormat("hf-bin", "pytorch_model", ".bin", ("bin", "pytorch", "hf_bin")))
