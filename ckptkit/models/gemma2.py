"""Gemma 2: Gemma plus norms after attention and MLP (four per layer), attention and
final-logit soft-capping, ``query_pre_attn_scalar`` for the attention scale, and
sliding-window layers interleaved with global ones (``layer_types``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.features import SlidingWindow, SoftCapping
from ckptkit.models.gemma import GEMMA_GGUF, hidden_activation
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_llama_layout

GEMMA2_GGUF = GGUFSpec(
    "gemma2",
    ("Gemma2ForCausalLM",),
    (*GEMMA_GGUF.parameters, "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"),
    "spm_unprefixed",
    norm_plus_one=True,
    drops_output=True,
    sliding_pattern=2,
    query_scale_layers=(46,),
)


@dataclass
class Gemma2Fields(SlidingWindow, SoftCapping):
    """Per-layer attention kind (``sliding_attention`` / ``full_attention``), when the config lists them."""

    decoder = Decoder(norm_plus_one=True, embed_scale=True, post_norms=True)

    layer_types: list[str] | None = None


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
    fields: ClassVar[type[Gemma2Fields]] = Gemma2Fields
    sliding_pattern = 2
    gguf = GEMMA2_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg)
        body = tuple(r for r in base.layer if "layernorm" not in r.native)
        return Layout(base.head, body + gemma2_layer_norms(), base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        own = self.fields(
            sliding_window=cfg.get("sliding_window"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            layer_types=layer_types_of(cfg, int(cfg["num_hidden_layers"]), self.sliding_pattern),
        )
        return hf_common_config(
            cfg,
            self.name,
            own,
            hidden_act=hidden_activation(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        own = cfg.fields(Gemma2Fields)
        out.update(
            hidden_activation=cfg.hidden_act,
            attention_bias=False,
            initializer_range=0.02,
            query_pre_attn_scalar=own.query_pre_attn_scalar,
            sliding_window=own.sliding_window,
            layer_types=own.layer_types,
            attn_logit_softcapping=own.attn_logit_softcapping,
            final_logit_softcapping=own.final_logit_softcapping,
        )
        return out

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        own = cfg.fields(Gemma2Fields)
        types = own.layer_types or ["full_attention"] * cfg.num_layers
        return [own.sliding_window if t == "sliding_attention" else None for t in types]


register(Gemma2())
