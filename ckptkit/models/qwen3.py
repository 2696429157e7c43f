"""Qwen3 and Qwen3-MoE: Qwen2 without q/k/v biases, plus per-head RMSNorm of queries and
keys (``q_norm``/``k_norm``); Qwen3-MoE swaps the MLP of most layers for experts
(``mlp.experts.E.{gate,up,down}_proj`` + router ``mlp.gate``, or stacked)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.gguf_spec import MOE_TEXT_MODEL_PARAMETERS, TEXT_MODEL_PARAMETERS, GGUFExperts, GGUFSpec
from ckptkit.models.moe import MoEFields, expert_rules, expert_size, experts_layout_of, is_moe_layer
from ckptkit.models.qwen2 import Qwen2, Qwen2Fields
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_llama_layout

QWEN3_GGUF = GGUFSpec("qwen3", ("Qwen3ForCausalLM",), TEXT_MODEL_PARAMETERS, "bpe_or_spm")
QWEN3MOE_GGUF = GGUFSpec(
    "qwen3moe",
    ("Qwen3MoeForCausalLM",),
    (*MOE_TEXT_MODEL_PARAMETERS, "expert_feed_forward_length?"),
    "bpe",
    experts=GGUFExperts(("w2", "w1", "w3"), takes_stacked=True),
    implied=(("norm_topk_prob", True),),  # llama.cpp's qwen3moe graph always renormalises the top k
)


@dataclass
class Qwen3Fields(Qwen2Fields):
    """Qwen2's window fields; queries and keys RMS-normed per head."""

    decoder = Decoder(qk_norm="head")


@dataclass
class Qwen3MoeFields(Qwen3Fields, MoEFields):
    """Qwen3's fields and experts in the layers ``mlp_only_layers`` / ``decoder_sparse_step`` leave them."""


def qk_norm_rules() -> tuple[Rule, ...]:
    a = "model.layers.{i}.self_attn."
    return (
        Rule(a + "q_norm.weight", ("layers.{i}.attn.q_norm.scale",)),
        Rule(a + "k_norm.weight", ("layers.{i}.attn.k_norm.scale",)),
    )


class Qwen3(Qwen2):
    """Qwen2's config and sliding windows; no forced biases, q/k norms per head."""

    name = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architecture = "Qwen3ForCausalLM"
    fields: ClassVar[type[Qwen3Fields]] = Qwen3Fields
    gguf = QWEN3_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg, biases=cfg.attention_bias)
        o = 1 + next(j for j, r in enumerate(base.layer) if r.native.endswith("o_proj.weight"))
        return Layout(base.head, base.layer[:o] + qk_norm_rules() + base.layer[o:], base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(cfg, self.name, self.fields.from_hf(cfg))

    def attention_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.attention_bias}


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
    hf_architecture = "Qwen3MoeForCausalLM"
    fields: ClassVar[type[Qwen3MoeFields]] = Qwen3MoeFields
    gguf = QWEN3MOE_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        # Layers differ (dense or experts), so every layer's rules are spelled out.
        base = super().hf_layout(cfg)
        rules: list[Rule] = list(base.head)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp."
            for r in base.layer:
                if ".mlp." in r.native and is_moe_layer(cfg, i):
                    continue
                rules.append(r.at(i))
                if r.native.endswith("k_norm.weight") and is_moe_layer(cfg, i):
                    rules += expert_rules(cfg, i, p, ("gate_proj", "up_proj", "down_proj"), p + "gate.weight", p)
        return Layout(tuple(rules), (), base.tail, base.unused)

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        return experts_layout_of(cfg, names)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        model = super().config_from_hf(cfg)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(model.num_layers) if i in only or not (experts > 0 and (i + 1) % step == 0)]
        return model.replace_fields(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            dense_layers=dense,
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = super().config_to_hf(cfg, dtype)
        moe = cfg.fields(MoEFields)
        out.update(
            num_experts=moe.num_experts,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok,
            moe_intermediate_size=expert_size(cfg),
            norm_topk_prob=moe.norm_topk_prob,
            router_aux_loss_coef=moe.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=list(moe.dense_layers or []),
            output_router_logits=False,
        )
        return out


register(Qwen3(), Qwen3Moe())
