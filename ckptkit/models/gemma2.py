"""Gemma 2: Gemma plus norms after attention and MLP (four per layer), attention and
final-logit soft-capping, ``query_pre_attn_scalar`` for the attention scale, and
sliding-window layers interleaved with global ones (``layer_types``)."""

from __future__ import annotations

from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.gguf_spec import GEMMA2_GGUF
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_llama_layout


def gemma2_layer_norms() -> tuple[Rule, ...]:
    p = "model.layers.{i}."
    return (
        Rule(p + "input_layernorm.weight", ("layers.{i}.sa_norm.scale",)),
        Rule(p + "post_attention_layernorm.weight", ("layers.{i}.attn_post_norm.scale",)),
        Rule(p + "pre_feedforward_layernorm.weight", ("layers.{i}.mlp_norm.scale",)),
        Rule(p + "post_feedforward_layernorm.weight", ("layers.{i}.mlp_post_norm.scale",)),
    )


def layer_types_of(cfg: dict[str, Any], num_layers: int, pattern: int) -> list[str]:
    """``layer_types`` as written, else every ``pattern``-th layer global (older configs)."""
    types = cfg.get("layer_types")
    if types:
        return list(types)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


class Gemma2(Family):
    name = "gemma2"
    hf_model_types = ("gemma2",)
    hf_architecture = "Gemma2ForCausalLM"
    sliding_pattern = 2
    gguf = GEMMA2_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg)
        body = tuple(r for r in base.layer if "layernorm" not in r.native)
        return Layout(base.head, body + gemma2_layer_norms(), base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        layers = int(cfg["num_hidden_layers"])
        return hf_common_config(
            cfg,
            self.name,
            hidden_act=act,
            norm_plus_one=True,
            embed_scale=True,
            post_norms=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            layer_types=layer_types_of(cfg, layers, self.sliding_pattern),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        out.update(
            hidden_activation=cfg.hidden_act,
            attention_bias=False,
            initializer_range=0.02,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            sliding_window=cfg.sliding_window,
            layer_types=cfg.layer_types,
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping,
        )
        return out

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        types = cfg.layer_types or ["full_attention"] * cfg.num_layers
        return [cfg.sliding_window if t == "sliding_attention" else None for t in types]


FAMILIES = (Gemma2(),)
