"""The base class of a model family: its layouts per format and its config translation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkit.errors import NoMetaLayout
from ckptkit.models.config import FamilyFields, ModelConfig
from ckptkit.models.features import SlidingWindow
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.spec import Layout
from ckptkit.models.tokenizer_spec import TokenizerSpec

if TYPE_CHECKING:
    from ckptkit.tensors.lazy import Lazy


@dataclass
class MetaSource:
    """What a Meta-style checkpoint says about its model before any tensor is read.

    Attributes:
        params: ``params.json``.
        shapes: native tensor name -> shape (ranks merged).
        container: ``"pth"`` or ``"safetensors"``.
        output_repeats_embeddings: whether ``output.weight`` has the embeddings' dtype and
            shape and starts with the same bytes (a fixed-size sample; called only if needed).
    """

    params: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    container: str
    output_repeats_embeddings: Callable[[], bool]


class Family:
    """A model type. Subclasses fill in the class attributes and the config translation;
    a family module registers its families (:func:`ckptkit.models.registry.register`).

    Attributes:
        name: the model type users pass to ``--model-type``.
        fields: the config fields only this family has (``ModelConfig.extra``) and the
            decoder features it uses.
        hf_model_types: ``config.json`` ``model_type`` values this family may have.
        meta_container: ``"pth"`` or ``"safetensors"`` when the family has a Meta
            layout (Mistral publishes ``consolidated.safetensors``), else None.
        vocab_parallel: Meta ranks split ``tok_embeddings`` on the vocabulary (dim 0)
            rather than on the hidden dim (dim 1).
        tokenizer: how Meta's and HF's releases of the family hold its tokenizer (None:
            the family has no Meta release, its tokenizer files are carried as they are).
        gguf: how llama.cpp's converter writes it (:mod:`ckptkit.models.gguf_spec`; None:
            llama.cpp has no model class for it).
        gguf_not_yet: the llama.cpp architecture that converts the family where ckptkit
            does not write it yet (with ``gguf`` None).
    """

    name: ClassVar[str]
    hf_model_types: ClassVar[tuple[str, ...]]
    hf_architecture: ClassVar[str]
    fields: ClassVar[type[FamilyFields]] = FamilyFields
    meta_container: ClassVar[str | None] = None
    vocab_parallel: ClassVar[bool] = False
    tokenizer: ClassVar[TokenizerSpec | None] = None
    gguf: ClassVar[GGUFSpec | None] = None
    gguf_not_yet: ClassVar[str | None] = None

    # --- layouts -------------------------------------------------------------
    def hf_layout(self, cfg: ModelConfig) -> Layout:
        raise NotImplementedError

    def meta_layout(self, cfg: ModelConfig) -> Layout:
        raise NoMetaLayout(f"{self.name} has no Meta layout")

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout | None:
        """The family's own DCP names, torchtitan's 2026 spelling if ``titan`` (read: the
        earlier one); None: its Meta layout, which the DCP formats respell themselves."""
        return None

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """The model config a DCP folder gets: its file name and contents (Meta's params.json)."""
        return "params.json", self.config_to_meta(cfg)

    def meta_extra_tensors(self, cfg: ModelConfig) -> dict[str, Lazy]:
        """Tensors Meta's own checkpoints carry that the model does not use (generated, with
        ``raw`` bytes so that writing them needs no torch)."""
        return {}

    def gguf_spec(self) -> GGUFSpec | None:
        """The llama.cpp model class that converts this family (``gguf``, where its HF
        architecture is one the spec lists), or None when llama.cpp has none."""
        spec = self.gguf
        return spec if spec is not None and self.hf_architecture in spec.hf_architectures else None

    def no_gguf(self, where: object) -> str:
        """Why ``where`` (of this family) cannot be written as GGUF: one line."""
        if self.gguf_not_yet:
            return f"{where}: ckptkit does not write {self.name} as GGUF yet (llama.cpp's {self.gguf_not_yet})"
        return f"{where}: llama.cpp has no GGUF architecture for model type {self.name}"

    # --- configs -------------------------------------------------------------
    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        raise NotImplementedError

    def config_from_meta(self, src: MetaSource) -> ModelConfig:
        raise NoMetaLayout(f"{self.name} has no Meta layout")

    def config_to_meta(self, cfg: ModelConfig) -> dict[str, Any]:
        raise NoMetaLayout(f"{self.name} has no Meta layout")

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        """What the tensor names of a checkpoint add to its config (which on-disk layout
        of the experts it uses, say); the config as read by default."""
        return cfg

    def layer_names(self, cfg: ModelConfig, names: Iterable[str]) -> list[str]:
        """The tensor names whose ``layers.N`` index counts toward ``num_layers`` (the
        checkpoint's layer count is checked on them): all by default."""
        return list(names)

    def sample_configs(self) -> list[ModelConfig]:
        """Tiny configs whose layers hold, together, every kind of tensor the family names (for
        maps of names, not shapes): one layer, biases on, the family's default fields."""
        return [ModelConfig(self.name, 2, 2, 1, 1, 1, 2, 2, attention_bias=True, extra=self.fields())]

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]] | None:
        """Every canonical tensor with its shape where the family's differ from the shared
        decoder's (:func:`ckptkit.models.shapes.canonical_shapes`); None: the shared ones."""
        return None

    # --- the native model ------------------------------------------------------
    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        """Per-layer attention window (None: full causal attention); the same in every
        layer unless the family says otherwise."""
        window = cfg.feature(SlidingWindow)
        return [window.sliding_window if window else None] * cfg.num_layers
