"""Qwen2: Llama's HF naming plus q/k/v biases; small models tie the embeddings; a sliding
window only with ``use_sliding_window``, from layer ``max_window_layers`` on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.features import SlidingWindow
from ckptkit.models.fields import boolean, non_negative_int, optional
from ckptkit.models.gguf_spec import TEXT_MODEL_PARAMETERS, GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, hf_common_config, hf_common_fields, hf_llama_layout

QWEN2_GGUF = GGUFSpec("qwen2", ("Qwen2ForCausalLM",), TEXT_MODEL_PARAMETERS, "bpe_or_spm")


@dataclass
class Qwen2Fields(SlidingWindow):
    """The window slides only with ``use_sliding_window``, in the layers from ``max_window_layers`` on."""

    checks = {"use_sliding_window": boolean, "max_window_layers": optional(non_negative_int)}

    use_sliding_window: bool = False
    max_window_layers: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Self:
        return cls(
            sliding_window=cfg.get("sliding_window"),
            use_sliding_window=bool(cfg.get("use_sliding_window", False)),
            max_window_layers=cfg.get("max_window_layers"),
        )


class Qwen2(Family):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"
    fields: ClassVar[type[Qwen2Fields]] = Qwen2Fields
    gguf = QWEN2_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg, biases=True)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(cfg, self.name, self.fields.from_hf(cfg), attention_bias=True)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        out.update(self.attention_fields(cfg))
        own = cfg.fields(Qwen2Fields)
        out.update(
            use_sliding_window=own.use_sliding_window,
            sliding_window=own.sliding_window,
            max_window_layers=cfg.num_layers if own.max_window_layers is None else own.max_window_layers,
            initializer_range=0.02,
        )
        return out

    def attention_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json fields about attention beyond the common ones (Qwen2 has none)."""
        return {}

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        """Qwen2 slides only with ``use_sliding_window``, and then from ``max_window_layers`` on."""
        own = cfg.fields(Qwen2Fields)
        if not own.use_sliding_window:
            return [None] * cfg.num_layers
        first = 28 if own.max_window_layers is None else own.max_window_layers  # transformers' default
        return [own.sliding_window if i >= first else None for i in range(cfg.num_layers)]


register(Qwen2())
