"""Mistral: Llama's naming, GQA, a sliding window, and Meta-style ``consolidated.safetensors`` releases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import MetaSource
from ckptkit.models.features import SlidingWindow
from ckptkit.models.llama import Llama3, MetaFFN
from ckptkit.models.registry import register
from ckptkit.models.spec import hf_common_config, hf_common_fields
from ckptkit.models.tokenizer_spec import SENTENCEPIECE, TokenizerSpec

MISTRAL_TOKENIZER = TokenizerSpec(SENTENCEPIECE)  # Mistral's sentencepiece model, nothing more


@dataclass
class MistralFields(MetaFFN, SlidingWindow):
    """Llama's Meta FFN spelling and a sliding window in every layer."""


class Mistral(Llama3):
    name = "mistral"
    tokenizer = MISTRAL_TOKENIZER
    hf_model_types = ("mistral",)
    hf_architecture = "MistralForCausalLM"
    fields: ClassVar[type[MistralFields]] = MistralFields
    meta_container = "safetensors"
    default_theta = 1000000.0
    max_positions = 32768

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(cfg, self.name, self.fields(sliding_window=cfg.get("sliding_window")))

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "mistral", dtype)
        out.update(sliding_window=cfg.fields(SlidingWindow).sliding_window, initializer_range=0.02)
        return out

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
        window = cfg.fields(SlidingWindow).sliding_window
        if window:
            out["sliding_window"] = window
        return out

    def config_from_meta(self, src: MetaSource) -> ModelConfig:
        return super().config_from_meta(src).replace_fields(sliding_window=src.params.get("sliding_window"))


def detect_meta(src: MetaSource, where: str) -> str | None:
    """Mistral's Meta-style releases: ``consolidated.safetensors``, or params with hidden_dim / head_dim."""
    if src.container == Mistral.meta_container or "hidden_dim" in src.params or "head_dim" in src.params:
        return "mistral"
    return None


register(Mistral(), detect_meta=detect_meta)
