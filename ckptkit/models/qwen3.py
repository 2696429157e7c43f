"""Qwen3 and Qwen3-MoE: Qwen2 without q/k/v biases, plus per-head RMSNorm of queries and
keys (``q_norm``/``k_norm``); Qwen3-MoE swaps the MLP of most layers for experts
(``mlp.experts.E.{gate,up,down}_proj`` + router ``mlp.gate``, or stacked)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ckptkit.models.config import ModelConfig
from ckptkit.models.gguf_spec import QWEN3_GGUF, QWEN3MOE_GGUF
from ckptkit.models.moe import expert_rules, experts_layout_of
from ckptkit.models.qwen2 import Qwen2
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_llama_layout


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
    gguf = QWEN3_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg, biases=cfg.attention_bias)
        o = 1 + next(j for j, r in enumerate(base.layer) if r.native.endswith("o_proj.weight"))
        return Layout(base.head, base.layer[:o] + qk_norm_rules() + base.layer[o:], base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(
            cfg,
            self.name,
            qk_norm="head",
            use_sliding_window=bool(cfg.get("use_sliding_window", False)),
            max_window_layers=cfg.get("max_window_layers"),
        )

    def attention_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.attention_bias}


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
    hf_architecture = "Qwen3MoeForCausalLM"
    gguf = QWEN3MOE_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        # Layers differ (dense or experts), so every layer's rules are spelled out.
        base = super().hf_layout(cfg)
        rules: list[Rule] = list(base.head)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp."
            for r in base.layer:
                if ".mlp." in r.native and cfg.is_moe_layer(i):
                    continue
                rules.append(r.at(i))
                if r.native.endswith("k_norm.weight") and cfg.is_moe_layer(i):
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
        return dataclasses.replace(
            model,
            model_type=self.name,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            dense_layers=dense,
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = super().config_to_hf(cfg, dtype)
        out.update(
            num_experts=cfg.num_experts,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_size,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=list(cfg.dense_layers or []),
            output_router_logits=False,
        )
        return out


FAMILIES = (Qwen3(), Qwen3Moe())
