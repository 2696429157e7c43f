"""OLMo 2: norms on the outputs of attention and MLP only (no input norms), and RMSNorm
of queries and keys over the whole projection (``q_norm`` [heads * head_dim])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, FamilyFields, ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.gguf_spec import TEXT_MODEL_PARAMETERS, GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_llama_layout

OLMO2_GGUF = GGUFSpec("olmo2", ("Olmo2ForCausalLM",), TEXT_MODEL_PARAMETERS, "bpe")


@dataclass
class Olmo2Fields(FamilyFields):
    """No fields of its own; norms only on the sublayers' outputs, q/k norms over the projections."""

    decoder = Decoder(input_norms=False, post_norms=True, qk_norm="proj")


class Olmo2(Family):
    name = "olmo2"
    hf_model_types = ("olmo2",)
    hf_architecture = "Olmo2ForCausalLM"
    fields: ClassVar[type[Olmo2Fields]] = Olmo2Fields
    gguf = OLMO2_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg)
        body = tuple(r for r in base.layer if "layernorm" not in r.native)
        p = "model.layers.{i}."
        norms = (
            Rule(p + "self_attn.q_norm.weight", ("layers.{i}.attn.q_norm.scale",)),
            Rule(p + "self_attn.k_norm.weight", ("layers.{i}.attn.k_norm.scale",)),
            Rule(p + "post_attention_layernorm.weight", ("layers.{i}.attn_post_norm.scale",)),
            Rule(p + "post_feedforward_layernorm.weight", ("layers.{i}.mlp_post_norm.scale",)),
        )
        return Layout(base.head, body + norms, base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(cfg, self.name, Olmo2Fields())

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        out.update(attention_bias=False, initializer_range=0.02)
        return out


register(Olmo2())
