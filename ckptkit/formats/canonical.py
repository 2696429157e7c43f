"""Native <-> canonical tensors through a family's :class:`~ckptkit.models.spec.Layout`.

Reading (:func:`canonical_view`) calls each rule's transform ``forward``; writing
(:func:`native_targets`) calls its ``inverse``. Both stay lazy: nothing is read until a
tensor's ``get()`` is called.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.formats.base import RawCheckpoint
from ckptkit.io import Span
from ckptkit.models import ModelConfig, canonical_shapes
from ckptkit.models.spec import Layout, Rule
from ckptkit.tensors.lazy import Lazy

if TYPE_CHECKING:
    import torch

    from ckptkit.io import Rows


def canonical_view(raw: RawCheckpoint, layout: Layout, cfg: ModelConfig) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
    """(canonical name -> tensor, native name -> tensor the model does not use), checked
    against the config: every tensor present, none unknown, every shape as implied."""
    expected = canonical_shapes(cfg)
    found: dict[str, Lazy] = {}
    duplicates: list[str] = []
    used: set[str] = set()
    cache: dict[str, Any] = {}
    span_cache: dict[int, Any] = {}
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
        if rule.kind.duplicate:
            duplicates.append(rule.native)
            continue
        try:
            shapes = rule.kind.part_shapes(info.shape, [expected.get(c) for c in rule.canonical])
        except ValueError as e:
            raise CkptkitError(
                f"{raw.root / info.file}: {rule.native} has {e}: the config contradicts the tensor shapes"
            ) from None
        for j, (name, shape) in enumerate(zip(rule.canonical, shapes, strict=True)):
            getter = _forward_getter(raw, rule, cfg, shapes, j, cache)
            spans, rows = _forward_spans(raw, rule, cfg, shapes, j, span_cache), _forward_rows(raw, rule, cfg)
            found[name] = Lazy(shape, info.dtype, getter, info.file, spans, rows=rows)
    unused: dict[str, Lazy] = {}
    unknown = []
    for key, info in raw.infos.items():
        if key in used:
            continue
        if layout.is_unused(key):
            unused[key] = Lazy(info.shape, info.dtype, _reader(raw, key), info.file, functools.partial(raw.spans, key))
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
    if duplicates:
        tensors["tok_embeddings.weight"] = _checked_duplicate(raw, tensors["tok_embeddings.weight"], duplicates)
    return tensors, unused


def _reader(raw: RawCheckpoint, native: str) -> Callable[[], torch.Tensor]:
    return lambda: raw.read(native)


def _forward_getter(
    raw: RawCheckpoint, rule: Rule, cfg: ModelConfig, shapes: list[tuple[int, ...]], j: int, cache: dict[str, Any]
) -> Callable[[], torch.Tensor]:
    if len(rule.canonical) == 1:
        return lambda: rule.kind.forward(raw.read(rule.native), cfg, shapes)[0]

    def get() -> torch.Tensor:
        if cache.get("name") != rule.native:  # keep the last split tensor: q, k, v come in a row
            cache.update(name=rule.native, parts=rule.kind.forward(raw.read(rule.native), cfg, shapes))
        return cache["parts"][j]

    return get


SPLITS_KEPT = 8  # native tensors whose parts' spans are kept (a rule held keeps its id unique)


def _forward_spans(
    raw: RawCheckpoint, rule: Rule, cfg: ModelConfig, shapes: list[tuple[int, ...]], j: int, cache: dict[int, Any]
) -> Callable[[], list[Span] | None]:
    def spans() -> list[Span] | None:
        key = id(rule)  # the last few rules' splits kept: a layer's stacks' parts are asked for in turn
        entry: tuple[Rule, list[list[Span] | None] | None] | None = cache.get(key)  # held: safe from eviction
        if entry is None:
            native = raw.spans(rule.native)
            shape = raw.info(rule.native).shape
            entry = cache[key] = rule, None if native is None else rule.kind.forward_spans(native, shape, cfg, shapes)
            while len(cache) > SPLITS_KEPT:
                cache.pop(next(iter(cache)), None)
        part = None if entry[1] is None else entry[1][j]
        return None if part is None else list(part)

    return spans


def _forward_rows(raw: RawCheckpoint, rule: Rule, cfg: ModelConfig) -> Callable[[Rows], list[Span] | None] | None:
    if not rule.kind.permutes_rows:
        return None

    def rows(order: Rows) -> list[Span] | None:
        native = raw.spans(rule.native)
        if native is None:
            return None
        return rule.kind.forward_rows(native, raw.info(rule.native).shape, cfg, order)

    return rows


def _checked_duplicate(raw: RawCheckpoint, emb: Lazy, copies: list[str]) -> Lazy:
    pending = list(copies)  # each stored copy is compared once, on the first read

    def get() -> torch.Tensor:
        import torch

        t = emb.get()
        while pending:
            native = pending[0]
            if not torch.equal(raw.read(native), t):
                raise UnknownModel(
                    f"{raw.root}: {native} differs from the embeddings although this model type ties them; "
                    "pass --model-type for an untied variant (e.g. llama3_1)"
                )
            pending.pop(0)
        return t

    return Lazy(emb.shape, emb.dtype, get, emb.file)


def native_targets(tensors: dict[str, Lazy], layout: Layout, cfg: ModelConfig, with_optional: bool) -> dict[str, Lazy]:
    """Native name -> tensor to write, in the layout's order (optional rules only when asked)."""
    out: dict[str, Lazy] = {}
    for rule in layout.expand(cfg.num_layers):
        if rule.optional and not with_optional:
            continue
        parts = [tensors[c] for c in rule.canonical]
        shape = rule.kind.native_shape([p.shape for p in parts])
        getter, spans = _inverse_getter(rule, parts, cfg), _inverse_spans(rule, parts, cfg)
        same = rule.kind.is_identity() and not rule.kind.duplicate
        rows = parts[0].rows if same else None  # the same tensor: its rows lie where the canonical one's do
        pieces = parts[0].pieces if same else None  # and its bytes are the same pieces
        out[rule.native] = Lazy(shape, parts[0].dtype, getter, spans=spans, rows=rows, pieces=pieces)
    return out


def _inverse_getter(rule: Rule, parts: list[Lazy], cfg: ModelConfig) -> Callable[[], torch.Tensor]:
    return lambda: rule.kind.inverse([p.get() for p in parts], cfg)


def _inverse_spans(rule: Rule, parts: list[Lazy], cfg: ModelConfig) -> Callable[[], list[Span] | None]:
    def spans() -> list[Span] | None:
        found = [p.spans() for p in parts]
        if any(f is None for f in found) or any(p.dtype != parts[0].dtype for p in parts):
            return None
        return rule.kind.inverse_spans([f for f in found if f is not None], [p.shape for p in parts], cfg)

    return spans
