"""Gemma (1): tied embeddings scaled by sqrt(hidden), RMSNorm by (1 + weight), GeGLU,
and a head_dim that is not hidden_size / num_heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, FamilyFields, ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, hf_common_config, hf_common_fields, hf_llama_layout

GEMMA_GGUF = GGUFSpec(
    "gemma",
    ("GemmaForCausalLM",),
    (
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "head_count",
        "head_count_kv",
        "layer_norm_rms_eps",
        "head_dim",
        "file_type",
    ),  # fmt: skip
    "gemma",
    norm_plus_one=True,
    drops_output=True,
)


@dataclass
class GemmaFields(FamilyFields):
    """No fields of its own; norms by ``1 + weight`` and scaled embeddings."""

    decoder = Decoder(norm_plus_one=True, embed_scale=True)


def hidden_activation(cfg: dict[str, Any]) -> str:
    return str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")


class Gemma(Family):
    name = "gemma"
    hf_model_types = ("gemma",)
    hf_architecture = "GemmaForCausalLM"
    fields: ClassVar[type[GemmaFields]] = GemmaFields
    gguf = GEMMA_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        # Gemma's weights hold no lm_head: the output is always the embeddings.
        return hf_common_config(
            cfg,
            self.name,
            GemmaFields(),
            hidden_act=hidden_activation(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "gemma", dtype)
        out.update(hidden_activation=cfg.hidden_act, attention_bias=False, initializer_range=0.02)
        return out


register(Gemma())
