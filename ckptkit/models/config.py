"""The model config every format is translated to and from: the fields every decoder has,
plus the fields only its family has (a :class:`FamilyFields` dataclass the family declares)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from ckptkit.errors import CkptkitError


@dataclass(frozen=True)
class Decoder:
    """The decoder features a family's model always uses, whatever its config says.

    Attributes:
        norm_plus_one: RMSNorm scales by ``1 + weight`` (Gemma).
        embed_scale: the embeddings are multiplied by ``sqrt(hidden_size)`` (Gemma).
        input_norms: norms before attention and MLP (``sa_norm``, ``mlp_norm``).
        post_norms: norms on their outputs (``attn_post_norm``, ``mlp_post_norm``; Gemma 2/3, OLMo 2).
        qk_norm: RMSNorm of queries and keys: ``"head"`` (per head, ``head_dim`` wide; Qwen3,
            Gemma 3) or ``"proj"`` (over the whole projection; OLMo 2); None: none.
    """

    norm_plus_one: bool = False
    embed_scale: bool = False
    input_norms: bool = True
    post_norms: bool = False
    qk_norm: str | None = None


@dataclass
class FamilyFields:
    """The config fields of one family beyond :class:`ModelConfig`'s: none here.

    A family declares a subclass (a dataclass, every field with a default) as its
    ``Family.fields`` and its decoder features as ``decoder``; groups of fields several
    families share (a sliding window, experts, soft-capping) are small subclasses to inherit
    from, which the native decoder and the formats recognise by type. ``checks`` gives each
    of the class's own fields its check (:mod:`ckptkit.models.fields`), applied where a
    config.json or ckptkit.json holds the field.
    """

    decoder: ClassVar[Decoder] = Decoder()
    checks: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    @classmethod
    def all_checks(cls) -> dict[str, Callable[[Any], bool]]:
        """The checks of every field, the inherited ones included."""
        out: dict[str, Callable[[Any], bool]] = {}
        for base in reversed(cls.__mro__):
            out.update(vars(base).get("checks", {}))
        return out

    def decoder_features(self) -> Decoder:
        """The decoder features of this config: the family's ``decoder``, unless a field of
        its own switches one (GLM-4.5's ``use_qk_norm``)."""
        return self.decoder

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The fields of this class that ``data`` holds (the others keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


F = TypeVar("F", bound=FamilyFields)


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer, in ckptkit's canonical terms.

    Canonical tensor names (HF rotate-half rope layout for q/k, every family):

        tok_embeddings.weight
        layers.{i}.sa_norm.scale
        layers.{i}.attn.{q,k,v}_proj.weight     (+ .bias when ``attention_bias``)
        layers.{i}.attn.output_proj.weight
        layers.{i}.mlp_norm.scale
        layers.{i}.mlp.w1.weight  (gate)   layers.{i}.mlp.w3.weight  (up)
        layers.{i}.mlp.w2.weight  (down)
        norm.scale
        output.weight                            (absent when ``tie_word_embeddings``)

    plus what the family's decoder features add (:func:`ckptkit.models.shapes.canonical_shapes`).
    ``extra`` holds the fields only the family has (its ``Family.fields``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style llama3 scaling dict: rope_type, factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings. None: plain rope.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: FamilyFields = field(default_factory=FamilyFields)

    @property
    def decoder(self) -> Decoder:
        """The decoder features of the family."""
        return self.extra.decoder_features()

    def fields(self, kind: type[F]) -> F:
        """``extra`` as the family's own ``kind`` of fields; an error when it holds another's."""
        if not isinstance(self.extra, kind):
            raise CkptkitError(f"{self.model_type}: config has {type(self.extra).__name__}, not {kind.__name__}")
        return self.extra

    def feature(self, kind: type[F]) -> F | None:
        """``extra`` when the family has the group of fields ``kind`` (a sliding window...), else None."""
        return self.extra if isinstance(self.extra, kind) else None

    def replace_fields(self, **changes: Any) -> ModelConfig:
        """A copy with some of the family's own fields changed."""
        return dataclasses.replace(self, extra=dataclasses.replace(self.extra, **changes))

    def to_dict(self) -> dict[str, Any]:
        """The common fields, the decoder features, then the family's own fields."""
        out = dataclasses.asdict(self)
        del out["extra"]
        return out | dataclasses.asdict(self.decoder) | self.extra.to_dict()

    @classmethod
    def from_dict(cls, data: dict[str, Any], fields: type[FamilyFields] = FamilyFields) -> ModelConfig:
        """The inverse of :meth:`to_dict` for a family whose own fields are ``fields``; also
        reads the ``extra`` dict of older ckptkit.json files."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        merged = {**(data.get("extra") or {}), **data}
        return cls(**{k: v for k, v in merged.items() if k in names}, extra=fields.from_dict(merged))
