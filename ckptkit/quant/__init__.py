"""Quantized checkpoints (a ``quantization_config`` in the model config): which stored
tensors are quantized weights and which their scales, and the lazy views a conversion
plans with: the weights as stored with their scales beside them (kept), or dequantized by
the method's reference recipe (one tensor and its scale at a time), or quantized
(``--dtype fp8``).

A method is one module registering a :class:`~ckptkit.quant.method.QuantMethod`
(``fp8.py``, ``mxfp4.py``); formats only carry the scale tensors under the names the method gives them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, note
from ckptkit.io import read_spans
from ckptkit.quant import compressed, fp8, mistral, modelopt, mxfp4, nvfp4, packed
from ckptkit.quant.method import METHODS, QuantMethod, Stored, method_for
from ckptkit.tensors import float_bits
from ckptkit.tensors.dtypes import tensor_bytes, to_torch
from ckptkit.tensors.lazy import Lazy

if TYPE_CHECKING:
    import torch

    from ckptkit.io import Span
    from ckptkit.tensors.transforms import Transform

__all__ = [
    "FP8_DTYPE", "METHODS", "Quantization", "QuantMethod", "dequantized", "found_quantization", "quantizable",
    "source_quant_config",
    "quantized", "keeps_in", "recorded_scales", "with_scales",
]  # fmt: skip

FP8_DTYPE = "fp8"  # --dtype fp8: block FP8 as DeepSeek's and Qwen's releases are made
DEFAULT_DEQUANTIZED = "bfloat16"
QUANT_KEY = "quantization_config"
_QUANTIZABLE = re.compile(r"layers\.\d+\..*\.weight")
_NOT_QUANTIZED = ("router", "norm", "embed")


@dataclass
class Quantization:
    """A checkpoint's quantized weights: the method (its config as stored), each quantized
    canonical weight's scale, and the activation-only scales that were dropped."""

    method: QuantMethod
    scales: dict[str, tuple[Lazy, ...]]  # canonical weight -> its scales as stored (method.scale_names order)
    dropped: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict[str, Any]:
        return self.method.config

    def scale(self, name: str) -> torch.Tensor:
        """Weight ``name``'s scale as the method's arithmetic takes it (:meth:`QuantMethod.combined`)."""
        return self.method.scale_of(self.scales[name])

    def describe(self, weights: dict[str, Lazy]) -> dict[str, Any]:
        """What ``inspect`` shows: the method, its blocks, stored and dequantized dtypes."""
        stored = sorted({weights[k].dtype for k in self.scales if k in weights})
        return self.method.describe() | {
            "stored": ", ".join(stored),
            "dequantized": DEFAULT_DEQUANTIZED,
            "quantized_tensors": len(self.scales),
            "dropped_activation_scales": len(self.dropped),
        }

    def notes(self) -> list[str]:
        if not self.dropped:
            return []
        return [
            note(
                f"dropped {len(self.dropped)} activation-only scale(s) ({', '.join(self.dropped[:2])}"
                f"{', ...' if len(self.dropped) > 2 else ''}): they scale activations, not weights"
            )
        ]


@dataclass
class Found:
    """What :func:`found_quantization` took out of a checkpoint's tensor list."""

    method: QuantMethod
    pairs: dict[str, tuple[Stored, ...]]  # native weight name -> its scales' infos (method.scale_names order)
    dropped: list[str]
    stored_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # weights shown in their model shape
    renamed: dict[str, str] = field(default_factory=dict)  # weights shown under their model name -> stored name


def source_quant_config(config: dict[str, Any], folder: Path | None = None) -> Any:
    """The ``quantization_config`` of a checkpoint's config (None: not quantized), or the
    one Mistral's params.json ``quantization`` amounts to, or (``folder``'s) the one a
    modelopt export's ``hf_quant_config.json`` amounts to."""
    if QUANT_KEY in config:
        return config[QUANT_KEY]
    found = mistral.mistral_config(config)
    if found is None and folder is not None:
        found = modelopt.hf_quant_config(folder)
    return found


def found_quantization(
    config: Any, infos: dict[str, Any], where: Path, read: Callable[[str], torch.Tensor] | None = None
) -> Found | None:
    """The quantization ``config`` (a ``quantization_config``, None: none) describes in
    ``infos``; its scales and activation-only scales are removed from ``infos`` and packed
    weights shown in the shape the model config implies (:meth:`QuantMethod.model_shape`;
    the caller puts them back once the model's tensors are named; ``read``: a stored tensor's
    values, for what only they settle, :meth:`QuantMethod.settle`). One line
    naming the tensor for a quantized weight without its scale, a scale without its weight
    or of the wrong shape or dtype, a config that contradicts the tensors."""
    if config is None:
        return None
    method = method_for(config, where)
    found: dict[str, dict[str, Stored]] = {}
    dropped = [k for k in infos if method.is_activation_scale(k)]
    for name, info in infos.items():
        weight = method.weight_of_scale(name)
        if weight is None:
            continue
        w = infos.get(method.stored_name(weight))
        if w is None:
            raise CkptkitError(
                f"{where.parent / info.file}: {name} is a scale, but there is no tensor {method.stored_name(weight)}"
            )
        if w.dtype != method.stored:
            raise CkptkitError(
                f"{where.parent / w.file}: {w.name} is {w.dtype} but has a scale {name}; "
                f"{method.name} weights are {method.stored}"
            )
        if method.keeps_unquantized(weight):
            raise CkptkitError(f"{where}: {method.skip_key} lists {weight}, which is stored quantized")
        method.check_pair(w, info)
        found.setdefault(weight, {})[name] = info
    pairs: dict[str, tuple[Stored, ...]] = {}
    for weight, scales in found.items():
        names = method.scale_names(weight)
        missing = [n for n in names if n not in scales]
        if missing:
            raise CkptkitError(
                f"{where.parent / infos[method.stored_name(weight)].file}: {weight} has {', '.join(scales)} but no "
                f"scale {missing[0]}; "
                f"{method.name} weights need {', '.join(names)}"
            )
        pairs[weight] = tuple(scales[n] for n in names)
    for name, info in infos.items():
        weight = method.model_name(name) or name
        if info.dtype == method.stored and weight not in pairs and method.weight_of_scale(name) is None:
            raise CkptkitError(
                f"{where.parent / info.file}: {name} is quantized ({info.dtype}) but has no scale "
                f"{method.scale_name(weight)}; refusing to copy raw {method.name} bytes as weights"
            )
    if not pairs:
        raise CkptkitError(f"{where}: quantization_config says {method.name}, but no tensor has a scale")
    if read is not None:
        method.settle(pairs, read)
    for name in [*dropped, *(n for w in pairs for n in method.scale_names(w))]:
        del infos[name]
    renamed = {w: method.stored_name(w) for w in pairs if method.stored_name(w) != w}
    if renamed:  # shown under the model's name, in stored order
        back = {s: w for w, s in renamed.items()}
        shown = {
            back.get(k, k): dataclasses.replace(v, name=back.get(k, k)) if k in back else v for k, v in infos.items()
        }
        infos.clear()
        infos.update(shown)
    shapes = {w: tuple(infos[w].shape) for w in pairs if method.model_shape(infos[w].shape) != tuple(infos[w].shape)}
    for w, shape in shapes.items():
        infos[w] = dataclasses.replace(infos[w], shape=method.model_shape(shape))
    return Found(method, pairs, dropped, shapes, renamed)


def bound(
    found: Found,
    rules: Iterable[tuple[str, tuple[str, ...], Transform]],
    tensors: dict[str, Lazy],
    reader: Any,
    cfg: Any,
) -> Quantization:
    """``found``'s scales by canonical weight name, through the format's ``rules`` (native,
    canonical, transform); ``reader`` has ``read(native)`` and ``spans(native)``; ``cfg``
    (the model's config) is what a row permutation of a per-row scale is made with."""
    by_native = {native: (canonical[0], kind) for native, canonical, kind in rules if len(canonical) == 1}
    scales: dict[str, tuple[Lazy, ...]] = {}
    method = found.method
    for native, infos in found.pairs.items():
        canonical, kind = by_native.get(native, (native, None))
        if canonical not in tensors:
            raise CkptkitError(f"{method.where}: {native} is quantized, but the model does not use it as a weight")
        found_scales = tuple(checked_scale(method, info, reader) for info in infos)
        if kind is not None and not kind.is_identity() and not whole_heads(kind, method, cfg.head_dim):
            if not (kind.permutes_rows and all(per_row(i.shape, tensors[canonical].shape) for i in infos)):
                raise CkptkitError(
                    f"{method.where}: {native} is stored with its rows moved across {method.name} blocks; "
                    "ckptkit reads such blocks only where they hold whole heads"
                )
            found_scales = tuple(rows_moved(s, kind, cfg, to_native=False) for s in found_scales)
        scales[canonical] = found_scales
        if native in found.stored_shapes:  # the model's view checked the unpacked shape: the weight as stored
            tensors[canonical] = dataclasses.replace(tensors[canonical], shape=found.stored_shapes[native])
    return Quantization(method, scales, found.dropped)


def per_row(scale: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """Whether a scale of shape ``scale`` has a row of its own for each row of a matrix of
    shape ``weight`` (per channel, or per group of columns): it moves with the weight's rows."""
    return len(scale) == 2 and len(weight) == 2 and scale[0] == weight[0] > 1


def rows_moved(scale: Lazy, kind: Transform, cfg: Any, to_native: bool) -> Lazy:
    """A per-row ``scale`` with its rows permuted as ``kind`` permutes its weight's: towards
    the format's native order (``to_native``) or back to the canonical one; spans too."""
    shape = scale.shape

    def get() -> torch.Tensor:
        t = scale.get()
        return kind.inverse([t], cfg) if to_native else kind.forward(t, cfg, [shape])[0]

    def spans() -> list[Span] | None:
        found = scale.spans()
        if found is None:
            return None
        if to_native:
            return kind.inverse_spans([found], [shape], cfg)
        return kind.forward_spans(found, shape, cfg, [shape])[0]

    return Lazy(shape, scale.dtype, get, scale.file, spans)


def whole_heads(kind: Transform, method: QuantMethod, head_dim: int) -> bool:
    """Whether ``kind`` only moves rows within heads that ``method``'s blocks hold whole."""
    return kind.permutes_rows and method.block_rows() % head_dim == 0


def checked_scale(method: QuantMethod, info: Stored, reader: Any) -> Lazy:
    """The scale tensor ``info``, its values checked whenever it is read or copied: by
    ``raw()`` without torch where the method checks arrays and the bytes lie in the source."""
    where = f"{method.where.parent / info.file}: {info.name}"

    def get() -> torch.Tensor:
        t = reader.read(info.name)
        method.check_scale_values(t, where)
        return t

    def raw() -> bytes:
        found = reader.spans(info.name) if method.checks_arrays else None
        if found is None:
            return bytes(tensor_bytes(get()))
        try:
            data = read_spans(found)
        except EOFError:
            raise CkptkitError(f"{where}: changed while it was read (shorter than its size)") from None
        method.check_scale_array(float_bits.as_float32(data, info.dtype, tuple(info.shape)), info.dtype, where)
        return data

    def spans() -> list[Span] | None:
        raw()  # a scale is small: checked before its bytes are copied
        found: list[Span] | None = reader.spans(info.name)
        return found

    return Lazy(info.shape, info.dtype, get, info.file, spans, raw=raw)


def dequantized(tensors: dict[str, Lazy], quant: Quantization, dtype: str) -> dict[str, Lazy]:
    """``tensors`` with each quantized weight dequantized to ``dtype`` as it is read (under the
    name and in the layout the method's model holds it, :meth:`QuantMethod.dequantized_as`)."""
    out: dict[str, Lazy] = {}
    for name, w in tensors.items():
        if name not in quant.scales:
            out[name] = w
            continue

        def get(w: Lazy = w, name: str = name) -> torch.Tensor:
            return quant.method.loaded(w.get(), quant.scale(name), to_torch(dtype))

        def pieces(lead: int, w: Lazy = w, name: str = name) -> Iterator[torch.Tensor | memoryview]:
            return quant.method.loaded_pieces(w, quant.scales[name], dtype, lead)

        new, shape = quant.method.dequantized_as(name, w.shape)
        out[new] = Lazy(shape, dtype, get, w.file, pieces=pieces)
    return out


def quantizable(name: str, lazy: Lazy) -> bool:
    """Whether ``--dtype fp8`` quantizes canonical tensor ``name``: a layer's linear weight
    (norms, embeddings, the router and the output head stay as they are, as releases do)."""
    return (
        len(lazy.shape) >= 2
        and _QUANTIZABLE.fullmatch(name) is not None
        and not any(part in name for part in _NOT_QUANTIZED)
    )


def quantized(tensors: dict[str, Lazy], method: QuantMethod) -> tuple[dict[str, Lazy], Quantization]:
    """``tensors`` quantized by ``method`` where :func:`quantizable`, the others as they
    are; each scale computed with its weight (one tensor at a time)."""
    out: dict[str, Lazy] = {}
    scales: dict[str, tuple[Lazy, ...]] = {}
    for name, lazy in tensors.items():
        if not quantizable(name, lazy):
            out[name] = lazy
            continue
        made: dict[str, torch.Tensor] = {}  # a weight's scale, computed with it (scales are small)

        def weight(lazy: Lazy = lazy, made: dict[str, torch.Tensor] = made) -> torch.Tensor:
            q, made["scale"] = method.quantize(lazy.get())
            return q

        def scale(lazy: Lazy = lazy, made: dict[str, torch.Tensor] = made) -> torch.Tensor:
            return made.pop("scale") if "scale" in made else method.quantize(lazy.get())[1]

        out[name] = Lazy(lazy.shape, method.stored, weight, lazy.file)
        scales[name] = (Lazy(method.scale_shape(lazy.shape), "float32", scale, lazy.file),)
    return out, Quantization(method, scales)


def keeps_in(
    quant: Quantization,
    rules: Iterable[tuple[str, tuple[str, ...], Transform]],
    head_dim: int,
    weights: dict[str, Lazy],
) -> bool:
    """Whether a layout of ``rules`` (native, canonical, transform) holds every quantized
    weight of ``weights`` (canonical) with its scale: unchanged, or (a per-row scale of a
    weight whose rows the layout permutes) with its rows permuted the same way; and under
    a name the method reads back as quantized (compressed-tensors' groups name HF modules)."""
    if not quant.method.keepable:
        return False
    kinds = {canonical[0]: (native, kind) for native, canonical, kind in rules if len(canonical) == 1}
    for name, found in quant.scales.items():
        native, kind = kinds.get(name, ("", None))
        if kind is None or not quant.method.reads_as_quantized(native):
            return False
        moved = kind.permutes_rows and all(per_row(s.shape, weights[name].shape) for s in found)
        if not (kind.is_identity() or whole_heads(kind, quant.method, head_dim) or moved):
            return False
    return True


def with_scales(
    targets: dict[str, Lazy], quant: Quantization, natives: dict[str, tuple[str, Transform | None]], cfg: Any
) -> tuple[dict[str, Lazy], dict[str, tuple[str, ...]]]:
    """(``targets`` (native name -> tensor) with each quantized weight's scales after it,
    native weight name -> its scales' names); ``natives``: canonical weight -> (native name,
    the rule's transform): a per-row scale of a weight whose rows it permutes is permuted
    the same way (with ``cfg``, the model's config)."""
    method = quant.method
    after: dict[str, dict[str, Lazy]] = {}
    for c, found in quant.scales.items():
        if c not in natives:
            continue
        native, kind = natives[c]
        if native in targets and kind is not None and not kind.is_identity() and kind.permutes_rows:
            if not whole_heads(kind, method, cfg.head_dim):
                found = tuple(
                    rows_moved(s, kind, cfg, to_native=True) if per_row(s.shape, targets[native].shape) else s
                    for s in found
                )
        after[native] = dict(zip(method.scale_names(native), found, strict=True))
    out: dict[str, Lazy] = {}
    for name, lazy in targets.items():
        out[method.stored_name(name) if name in after else name] = lazy
        out.update(after.get(name, {}))
    return out, {method.stored_name(w): tuple(s) for w, s in after.items() if w in targets}


def recorded_scales(config_text: str | None, names: Iterable[str]) -> set[str]:
    """The names among ``names`` that are scales (or activation scales) under the
    ``quantization_config`` of the recorded config file ``config_text``."""
    import json

    try:
        config = source_quant_config(json.loads(config_text or "{}"))
        method = method_for(config, Path("config")) if config is not None else None
    except (ValueError, AttributeError, CkptkitError):
        return set()
    if method is None:
        return set()
    return {
        n
        for n in names
        if method.weight_of_scale(n) is not None or method.is_activation_scale(n) or method.model_name(n) is not None
    }


assert fp8.BlockFP8.name in METHODS
assert compressed.CompressedTensors.name in METHODS
assert modelopt.ModelOptFP8.name in METHODS and nvfp4.ModelOptNVFP4 in modelopt.ModelOptFP8.variants.values()
assert mistral.MistralFP8.name in METHODS
assert mxfp4.MXFP4.name in METHODS
assert compressed.CompressedTensors.packed is packed.PackedCompressedTensors
