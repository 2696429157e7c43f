"""Gemma (1): tied embeddings scaled by sqrt(hidden), RMSNorm by (1 + weight), GeGLU,
and a head_dim that is not hidden_size / num_heads."""

from __future__ import annotations

from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.gguf_spec import GEMMA_GGUF
from ckptkit.models.spec import Layout, hf_common_config, hf_common_fields, hf_llama_layout


class Gemma(Family):
    name = "gemma"
    hf_model_types = ("gemma",)
    hf_architecture = "GemmaForCausalLM"
    gguf = GEMMA_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        # Gemma's weights hold no lm_head: the output is always the embeddings.
        return hf_common_config(
            cfg,
            self.name,
            hidden_act=act,
            norm_plus_one=True,
            embed_scale=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "gemma", dtype)
        out.update(hidden_activation=cfg.hidden_act, attention_bias=False, initializer_range=0.02)
        return out


FAMILIES = (Gemma(),)
