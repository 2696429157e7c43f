"""Gemma 3 (text): Gemma 2's four norms per layer plus per-head ``q_norm``/``k_norm``, no
soft-capping by default, and sliding-window layers with their own rope base
(``rope_parameters`` per layer type)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.gemma2 import Gemma2
from ckptkit.models.gguf_spec import GEMMA3_GGUF
from ckptkit.models.qwen3 import qk_norm_rules
from ckptkit.models.spec import Layout


class Gemma3Text(Gemma2):
    name = "gemma3_text"
    hf_model_types = ("gemma3_text",)
    hf_architecture = "Gemma3ForCausalLM"
    sliding_pattern = 6
    gguf = GEMMA3_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = super().hf_layout(cfg)
        o = 1 + next(j for j, r in enumerate(base.layer) if r.native.endswith("o_proj.weight"))
        return Layout(base.head, base.layer[:o] + qk_norm_rules() + base.layer[o:], base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        params = cfg.get("rope_parameters") or {}
        full = params.get("full_attention")
        local = params.get("sliding_attention")
        flat = dict(cfg)
        if isinstance(full, dict):  # transformers 5: one rope_parameters per layer type
            flat["rope_parameters"] = full
        model = super().config_from_hf(flat)
        local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        return dataclasses.replace(model, model_type=self.name, qk_norm="head", local_rope_theta=float(local_theta))

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = super().config_to_hf(cfg, dtype)
        full = out["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or 10000.0}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        out.pop("rope_theta", None)
        out.pop("rope_scaling", None)
        out.update(use_bidirectional_attention=False)
        return out


FAMILIES = (Gemma3Text(),)
