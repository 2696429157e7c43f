"""Qwen2: Llama's HF naming plus q/k/v biases; small models tie the embeddings."""

from __future__ import annotations

from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.spec import Layout, hf_common_config, hf_common_fields, hf_llama_layout


class Qwen2(Family):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg, biases=True)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        model = hf_common_config(cfg, self.name, attention_bias=True)
        for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
            if key in cfg:
                model.extra[key] = cfg[key]
        return model

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "qwen2", dtype)
        out.update(
            use_sliding_window=cfg.extra.get("use_sliding_window", False),
            sliding_window=cfg.extra.get("sliding_window"),
            max_window_layers=cfg.extra.get("max_window_layers", cfg.num_layers),
            initializer_range=0.02,
        )
        return out


FAMILIES = (Qwen2(),)
