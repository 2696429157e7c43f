"""Qwen2: Llama's HF naming plus q/k/v biases; small models tie the embeddings."""

from __future__ import annotations

from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.gguf_spec import QWEN2_GGUF
from ckptkit.models.spec import Layout, hf_common_config, hf_common_fields, hf_llama_layout


class Qwen2(Family):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"
    gguf = QWEN2_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg, biases=True)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(
            cfg,
            self.name,
            attention_bias=True,
            use_sliding_window=bool(cfg.get("use_sliding_window", False)),
            max_window_layers=cfg.get("max_window_layers"),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        out.update(self.attention_fields(cfg))
        out.update(
            use_sliding_window=cfg.use_sliding_window,
            sliding_window=cfg.sliding_window,
            max_window_layers=cfg.num_layers if cfg.max_window_layers is None else cfg.max_window_layers,
            initializer_range=0.02,
        )
        return out

    def attention_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json fields about attention beyond the common ones (Qwen2 has none)."""
        return {}

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        """Qwen2 slides only with ``use_sliding_window``, and then from ``max_window_layers`` on."""
        if not cfg.use_sliding_window:
            return [None] * cfg.num_layers
        first = 28 if cfg.max_window_layers is None else cfg.max_window_layers  # transformers' default
        return [cfg.sliding_window if i >= first else None for i in range(cfg.num_layers)]


FAMILIES = (Qwen2(),)
