"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``): grouped-query attention with q/k/v biases and optional
per-head q/k norms, rope on part of each head (``partial_rotary_factor``), and DeepSeek V3's
MLP: ``first_k_dense_replace`` dense layers, then routed experts with shared experts and a
router bias, and the NextN (MTP) layers past ``num_hidden_layers``, carried in every format
as :mod:`ckptkit.models.deepseek_v3` carries them. DCP holds torchtitan's spelling of the
same tensors (``attention.wq``, ``moe.experts.w1`` stacked...); torchtitan has no GLM model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.deepseek_v3 import DeepseekV3, Part, SharedExpertsFields, mlp_parts
from ckptkit.models.features import PartialRotary
from ckptkit.models.fields import boolean
from ckptkit.models.gguf_spec import GGUFExperts, GGUFSpec
from ckptkit.models.moe import expert_size
from ckptkit.models.registry import register
from ckptkit.models.spec import hf_common_config, hf_common_fields


@dataclass
class Glm4MoeFields(SharedExpertsFields, PartialRotary):
    """The experts and MTP layers, the rotated part of each head, whether q/k are normed."""

    checks = {"use_qk_norm": boolean}

    decoder = Decoder(qk_norm="head")
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False

    def decoder_features(self) -> Decoder:
        return self.decoder if self.use_qk_norm else Decoder()


def glm_layer_parts(cfg: ModelConfig, moe: bool) -> list[Part]:
    """The tensors of one layer (dense or with experts), in module order, experts one tensor each."""
    f = cfg.fields(Glm4MoeFields)
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
    parts: list[Part] = []
    for p, n in rows.items():
        parts.append(Part(f"self_attn.{p}_proj.weight", f"attn.{p}_proj.weight", f"attention.w{p}.weight", (n, h)))
        if cfg.attention_bias:
            parts.append(Part(f"self_attn.{p}_proj.bias", f"attn.{p}_proj.bias", f"attention.w{p}.bias", (n,)))
    parts.append(Part("self_attn.o_proj.weight", "attn.output_proj.weight", "attention.wo.weight", (h, rows["q"])))
    if f.use_qk_norm:
        for p in "qk":
            parts.append(Part(f"self_attn.{p}_norm.weight", f"attn.{p}_norm.scale", f"attention.{p}_norm.weight", (d,)))
    return parts + mlp_parts(cfg, moe)


# llama.cpp's Glm4MoeModel: TextModel's keys (block count with the NextN layers), then its own
GLM4MOE_GGUF = GGUFSpec(
    "glm4moe",
    ("Glm4MoeForCausalLM",),
    (
        "block_count_nextn",
        "context_length?",
        "embedding_length",
        "feed_forward_length",
        "head_count",
        "head_count_kv?",
        "rope_scaling",
        "rope_freq_base?",
        "layer_norm_rms_eps?",
        "expert_count",
        "expert_used_count",
        "expert_group_count?",
        "expert_group_used_count?",
        "expert_gating_func?",
        "head_dim?",
        "file_type",
        "rope_partial_head_dim",
        "expert_feed_forward_length?",
        "shared_expert_count?",
        "leading_dense_blocks?",
        "expert_gating_sigmoid",
        "expert_weights_scale?",
        "expert_weights_norm_value?",
        "nextn_predict_layers?",
    ),
    "glm",
    experts=GGUFExperts(("w2", "w1", "w3")),
)


class Glm4Moe(DeepseekV3):
    name = "glm4_moe"
    hf_model_types: ClassVar[tuple[str, ...]] = ("glm4_moe",)
    hf_architecture = "Glm4MoeForCausalLM"
    fields: ClassVar[type[Glm4MoeFields]] = Glm4MoeFields  # type: ignore[assignment]
    gguf = GLM4MOE_GGUF

    def layer_parts(self, cfg: ModelConfig, moe: bool) -> list[Part]:
        return glm_layer_parts(cfg, moe)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        experts = int(cfg.get("n_routed_experts") or 0)
        layers = int(cfg["num_hidden_layers"])
        dense = int(cfg.get("first_k_dense_replace") or 0) if experts else layers
        rope = cfg.get("rope_parameters") or {}
        own = self.fields(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=list(range(min(dense, layers))),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))),
            use_qk_norm=bool(cfg.get("use_qk_norm", False)),
        )
        return hf_common_config(cfg, self.name, own)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        f = cfg.fields(Glm4MoeFields)
        out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": f.partial_rotary_factor}
        out.update(
            attention_bias=cfg.attention_bias,
            first_k_dense_replace=len(f.dense_layers or []),
            initializer_range=0.02,
            moe_intermediate_size=expert_size(cfg),
            n_group=f.n_group,
            n_routed_experts=f.num_experts,
            n_shared_experts=f.n_shared_experts,
            norm_topk_prob=f.norm_topk_prob,
            num_experts_per_tok=f.num_experts_per_tok,
            num_nextn_predict_layers=f.num_nextn_predict_layers,
            output_router_logits=False,
            routed_scaling_factor=f.routed_scaling_factor,
            topk_group=f.topk_group,
            use_qk_norm=f.use_qk_norm,
        )
        return out


register(Glm4Moe())
