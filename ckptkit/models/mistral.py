"""Mistral: Llama's naming, GQA, and Meta-style ``consolidated.safetensors`` releases."""

from __future__ import annotations

from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.llama import Llama3
from ckptkit.models.spec import hf_common_fields


class Mistral(Llama3):
    name = "mistral"
    hf_model_types = ("mistral",)
    hf_architecture = "MistralForCausalLM"
    meta_container = "safetensors"
    default_theta = 1000000.0
    max_positions = 32768

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "mistral", dtype)
        out.update(sliding_window=cfg.extra.get("sliding_window"), initializer_range=0.02)
        return out

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        model = super().config_from_hf(cfg)
        model.extra["sliding_window"] = cfg.get("sliding_window")
        return model

    def config_to_meta(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dim": cfg.hidden_size,
            "n_layers": cfg.num_layers,
            "head_dim": cfg.head_dim,
            "hidden_dim": cfg.intermediate_size,
            "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads,
            "norm_eps": cfg.norm_eps,
            "vocab_size": cfg.vocab_size,
            "rope_theta": cfg.rope_theta,
        }
        if cfg.extra.get("sliding_window"):
            out["sliding_window"] = cfg.extra["sliding_window"]
        return out

    def config_from_meta(
        self, params: dict[str, Any], shapes: dict[str, tuple[int, ...]], tied: bool = False
    ) -> ModelConfig:
        model = super().config_from_meta(params, shapes, tied)
        model.extra = {"sliding_window": params.get("sliding_window")}
        return model


FAMILIES = (Mistral(),)
