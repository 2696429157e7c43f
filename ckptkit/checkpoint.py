"""Open any supported checkpoint as canonical tensors plus the layout it came from."""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.dtypes import ITEMSIZE, dtype_name, to_torch
from ckptkit.errors import CkptkitError
from ckptkit.formats import hf, internal, meta
from ckptkit.formats.base import INTERNAL_FILE, ORIGIN_FILE, RawCheckpoint, read_json
from ckptkit.models import ModelConfig, canonical_shapes, detect_from_hf, detect_from_meta, get_family
from ckptkit.models.family import Family
from ckptkit.models.spec import FUSED, ROPE_K, ROPE_Q, TIED, Layout

FORMATS = ("meta", "hf", "hf-bin", "internal")
TIE_SAMPLE_BYTES = 4096

if TYPE_CHECKING:
    import torch


@dataclass
class Lazy:
    """A tensor known by shape and dtype, materialised by ``get()``."""

    shape: tuple[int, ...]
    dtype: str  # a name, e.g. "bfloat16"
    get: Callable[[], torch.Tensor]
    file: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


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

    @functools.cached_property
    def own_layout(self) -> dict[str, Any]:
        """This checkpoint's layout, as recorded for converting back to it later."""
        if self.format == "internal":
            return self.recorded_origin or {}
        return own_layout(self.raw, self.family, self.unused)

    @property
    def origin(self) -> dict[str, Any]:
        return self.recorded_origin if self.recorded_origin is not None else self.own_layout

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def extra_files(self) -> list[Path]:
        """Top-level non-weight files to carry over (tokenizer, generation config, ...)."""
        skip = {self.raw.config_name, "config.json", "params.json", ORIGIN_FILE, INTERNAL_FILE}
        if self.raw.index:
            skip.add(self.raw.index["name"])
        skip.update(self.raw.files)
        out = []
        for p in sorted(self.path.iterdir()):
            if not p.is_file() or p.name in skip or p.name.startswith("."):
                continue
            if p.suffix in (".safetensors", ".bin", ".pth", ".pt", ".gguf") or p.name.endswith(".index.json"):
                continue  # weights of another layout shipped alongside
            out.append(p)
        return out


def detect_format(root: Path) -> str:
    """The format of a checkpoint directory, or a one-line error."""
    if not root.exists():
        raise CkptkitError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise CkptkitError(f"{root}: expected a checkpoint directory")
    if internal.detect(root):
        return "internal"
    if meta.detect(root):
        return "meta"
    if hf.detect(root, "hf"):
        return "hf"
    if hf.detect(root, "hf-bin"):
        return "hf-bin"
    if not any(root.iterdir()):
        raise CkptkitError(f"{root}: directory is empty")
    raise CkptkitError(
        f"{root}: not a recognised checkpoint (expected params.json + consolidated.*.pth, "
        "config.json + model*.safetensors or pytorch_model*.bin, or ckptkit.json)"
    )


def open_raw(root: Path, fmt: str) -> RawCheckpoint:
    if fmt == "internal":
        return internal.open_raw(root)
    if fmt == "meta":
        if not meta.detect(root):
            raise CkptkitError(f"{root}: not a Meta checkpoint (needs params.json and consolidated.*.pth)")
        return meta.open_raw(root)
    if fmt in ("hf", "hf-bin"):
        if not hf.detect(root, fmt):
            raise CkptkitError(
                f"{root}: not an {fmt} checkpoint (needs config.json and {hf.single_name(fmt)} or shards)"
            )
        return hf.open_raw(root, fmt)
    raise CkptkitError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def open_checkpoint(path: str | Path, fmt: str | None = None, model_type: str | None = None) -> Checkpoint:
    """Open a checkpoint directory read-only; nothing but headers is read yet."""
    root = Path(path)
    fmt = fmt or detect_format(root)
    raw = open_raw(root, fmt)
    try:
        return _build(root, raw, model_type)
    except BaseException:
        raw.close()
        raise


def _build(root: Path, raw: RawCheckpoint, model_type: str | None) -> Checkpoint:
    if raw.format == "internal":
        return _build_internal(root, raw, model_type)
    shapes = {k: i.shape for k, i in raw.infos.items()}
    where = root / raw.config_name
    if raw.format == "meta":
        tied = _meta_tied(raw)
        container = "safetensors" if meta.SAFETENSORS_FILE in raw.files else "pth"
        family = get_family(model_type) if model_type else detect_from_meta(raw.config, container, tied, str(where))
        try:
            cfg = family.config_from_meta(raw.config, shapes, tied)  # type: ignore[call-arg]
        except CkptkitError as e:
            raise CkptkitError(f"{where}: {e}") from None
        layout = family.meta_layout(cfg)
    else:
        family = get_family(model_type) if model_type else detect_from_hf(raw.config, str(where))
        try:
            cfg = family.config_from_hf(raw.config)
        except (KeyError, TypeError, ValueError) as e:
            raise CkptkitError(f"{where}: missing or invalid field {e}") from None
        layout = family.hf_layout(cfg)
    tensors, unused = _canonical_view(raw, layout, cfg)
    return Checkpoint(root, raw.format, family, cfg, raw, tensors, unused, _read_origin(root, raw))


def _meta_tied(raw: RawCheckpoint) -> bool:
    """Whether Meta's output.weight repeats tok_embeddings (Llama 3.2 vs 3.1).

    Judged from a fixed-size sample, so opening stays independent of the weights' size;
    a conversion still checks the whole tensors before it drops the copy.
    """
    emb, out = raw.infos.get("tok_embeddings.weight"), raw.infos.get("output.weight")
    if emb is None:
        return False
    if out is None:
        return True
    if not raw.config.get("use_scaled_rope") or emb.shape != out.shape or emb.dtype != out.dtype:
        return False
    reader = raw.readers[next(iter(raw.files))]
    a = reader.sample("tok_embeddings.weight", TIE_SAMPLE_BYTES)
    return a == reader.sample("output.weight", TIE_SAMPLE_BYTES)


def _canonical_view(raw: RawCheckpoint, layout: Layout, cfg: ModelConfig) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
    expected = canonical_shapes(cfg)
    found: dict[str, Lazy] = {}
    tied_native: list[str] = []
    used: set[str] = set()
    cache: dict[str, Any] = {}
    for rule in layout.expand(cfg.num_layers):
        info = raw.infos.get(rule.native)
        if info is None and rule.optional:
            continue
        if info is None:
            raise CkptkitError(
                f"{raw.root}: tensor {rule.native!r} is missing "
                f"({cfg.model_type} with {cfg.num_layers} layers needs it)"
            )
        used.add(rule.native)
        where = info.file
        if rule.kind == TIED:
            tied_native.append(rule.native)
            continue
        if rule.kind == FUSED:
            sizes = [expected.get(c, (0,))[0] for c in rule.canonical]
            if sum(sizes) != info.shape[0]:
                raise CkptkitError(
                    f"{raw.root / where}: {rule.native} has {info.shape[0]} rows but the config implies "
                    f"{' + '.join(map(str, sizes))}: the config contradicts the tensor shapes"
                )
            for j, c in enumerate(rule.canonical):
                found[c] = Lazy(
                    (sizes[j], *info.shape[1:]), info.dtype, _fused_getter(raw, rule.native, sizes, j, cache), where
                )
            continue
        heads = {ROPE_Q: cfg.num_heads, ROPE_K: cfg.num_kv_heads}.get(rule.kind)
        found[rule.canonical[0]] = Lazy(info.shape, info.dtype, _getter(raw, rule.native, heads), where)
    unused: dict[str, Lazy] = {}
    unknown = []
    for key, info in raw.infos.items():
        if key in used:
            continue
        if layout.is_unused(key):
            unused[key] = Lazy(info.shape, info.dtype, _getter(raw, key, None), info.file)
        else:
            unknown.append(key)
    if unknown:
        where = raw.infos[unknown[0]].file
        raise CkptkitError(
            f"{raw.root / where}: unknown tensor name(s) for {cfg.model_type}: {', '.join(unknown[:3])}"
            + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        )
    for name, shape in expected.items():
        lazy = found[name]
        if lazy.shape != shape:
            raise CkptkitError(
                f"{raw.root / lazy.file}: the config contradicts the tensor shapes: {name} is "
                f"{list(lazy.shape)} but {raw.config_name} implies {list(shape)}"
            )
    tensors = {name: found[name] for name in expected}
    if tied_native:
        tensors["tok_embeddings.weight"] = _checked_tie(raw, tensors["tok_embeddings.weight"], tied_native)
    return tensors, unused


def _getter(raw: RawCheckpoint, native: str, heads: int | None) -> Callable[[], torch.Tensor]:
    if heads is None:
        return lambda: raw.read(native)

    def get() -> torch.Tensor:
        from ckptkit.transforms import rope_meta_to_hf

        return rope_meta_to_hf(raw.read(native), heads)

    return get


def _fused_getter(
    raw: RawCheckpoint, native: str, sizes: list[int], j: int, cache: dict[str, Any]
) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        if cache.get("name") != native:  # keep the last fused tensor: q, k, v come in a row
            from ckptkit.transforms import split_rows

            cache.update(name=native, parts=split_rows(raw.read(native), sizes))
        return cache["parts"][j]

    return get


def _checked_tie(raw: RawCheckpoint, emb: Lazy, tied_native: list[str]) -> Lazy:
    pending = list(tied_native)  # each stored copy is compared once, on the first read

    def get() -> torch.Tensor:
        import torch

        t = emb.get()
        while pending:
            native = pending[0]
            if not torch.equal(raw.read(native), t):
                raise CkptkitError(
                    f"{raw.root}: {native} differs from the embeddings although this model type ties them; "
                    "pass --model-type for an untied variant (e.g. llama3_1)"
                )
            pending.pop(0)
        return t

    return Lazy(emb.shape, emb.dtype, get, emb.file)


def own_layout(raw: RawCheckpoint, family: Family, unused: dict[str, Lazy]) -> dict[str, Any]:
    """This checkpoint's layout, as recorded for converting back to it later."""
    small = {k: v for k, v in unused.items() if v.nbytes <= 1 << 16}
    return {
        "format": raw.format,
        "model_type": family.name,
        "files": [
            {"name": name, "keys": keys, "metadata": raw.file_metadata.get(name)} for name, keys in raw.files.items()
        ],
        "dtypes": {k: dtype_name(i.dtype) for k, i in raw.infos.items()},
        "split_dims": raw.split_dims,
        "config": {"name": raw.config_name, "text": raw.config_text},
        "index": raw.index,
        "unused": {k: encode_tensor(v.get()) for k, v in small.items()},
    }


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    import torch

    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def decode_tensor(d: dict[str, Any]) -> torch.Tensor:
    import torch

    buf = bytearray(base64.b64decode(d["data"]))
    return torch.frombuffer(buf, dtype=torch.uint8).view(to_torch(d["dtype"])).reshape(d["shape"]).clone()


def _read_origin(root: Path, raw: RawCheckpoint) -> dict[str, Any] | None:
    """The origin layout recorded beside converted weights, if it still matches them."""
    if raw.format == "internal":
        return None
    path = root / ORIGIN_FILE
    if not path.is_file():
        return None
    try:
        _, doc = read_json(path)
        written = doc["written"]
        sizes = {name: (root / name).stat().st_size for name in raw.files}
        if written["format"] != raw.format or written["files"] != sizes:
            return None
        return doc["origin"]
    except (CkptkitError, KeyError, TypeError, OSError):
        return None


def _build_internal(root: Path, raw: RawCheckpoint, model_type: str | None) -> Checkpoint:
    doc = raw.config
    try:
        cfg = ModelConfig.from_dict(doc["config"])
        family = get_family(model_type or cfg.model_type)
    except (KeyError, TypeError) as e:
        raise CkptkitError(f"{root / INTERNAL_FILE}: invalid config ({e})") from None
    tensors: dict[str, Lazy] = {}
    unused: dict[str, Lazy] = {}
    for key, info in raw.infos.items():
        lazy = Lazy(info.shape, info.dtype, _getter(raw, key, None), info.file)
        if key.startswith(internal.UNUSED_PREFIX):
            unused[key.removeprefix(internal.UNUSED_PREFIX)] = lazy
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
    tensors = {k: tensors[k] for k in expected}
    return Checkpoint(root, "internal", family, cfg, raw, tensors, unused, doc.get("origin") or {})


def load_checkpoint(path: str | Path, model_type: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load any checkpoint as (canonical config, canonical state dict), dtypes as stored."""
    with open_checkpoint(path, model_type=model_type) as ckpt:
        return ckpt.config, {k: v.get() for k, v in ckpt.tensors.items()}
