"""Phi-3: fused ``qkv_proj`` (q rows, then k, then v) and ``gate_up_proj`` (gate, then up),
split into canonical q/k/v and w1/w3 and fused back exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.features import PartialRotary, SlidingWindow
from ckptkit.models.fields import non_negative_float, optional, positive_int
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_output_rule
from ckptkit.tensors.transforms import FUSED

PHI3_GGUF = GGUFSpec(
    "phi3",
    ("Phi3ForCausalLM",),
    (
        "context_length",
        "rope_original_context",
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "head_count",
        "head_count_kv",
        "layer_norm_rms_eps",
        "rope_partial_dimensions",
        "rope_freq_base",
        "file_type",
        "sliding_window",
    ),  # fmt: skip
    "phi3",
)


@dataclass
class Phi3Fields(SlidingWindow, PartialRotary):
    """Carried for exact config.json round trips; None when the source config lacks them."""

    checks = {
        "original_max_position_embeddings": optional(positive_int),
        "resid_pdrop": optional(non_negative_float),
        "embd_pdrop": optional(non_negative_float),
    }

    original_max_position_embeddings: int | None = None
    resid_pdrop: float | None = None
    embd_pdrop: float | None = None


class Phi3(Family):
    name = "phi3"
    hf_model_types = ("phi3",)
    hf_architecture = "Phi3ForCausalLM"
    fields: ClassVar[type[Phi3Fields]] = Phi3Fields
    gguf = PHI3_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        p = "model.layers.{i}."
        layer = (
            Rule(
                p + "self_attn.qkv_proj.weight",
                ("layers.{i}.attn.q_proj.weight", "layers.{i}.attn.k_proj.weight", "layers.{i}.attn.v_proj.weight"),
                FUSED,
            ),
            Rule(p + "self_attn.o_proj.weight", ("layers.{i}.attn.output_proj.weight",)),
            Rule(p + "mlp.gate_up_proj.weight", ("layers.{i}.mlp.w1.weight", "layers.{i}.mlp.w3.weight"), FUSED),
            Rule(p + "mlp.down_proj.weight", ("layers.{i}.mlp.w2.weight",)),
            Rule(p + "input_layernorm.weight", ("layers.{i}.sa_norm.scale",)),
            Rule(p + "post_attention_layernorm.weight", ("layers.{i}.mlp_norm.scale",)),
        )
        return Layout(
            head=(Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)),),
            layer=layer,
            tail=(Rule("model.norm.weight", ("norm.scale",)), hf_output_rule(cfg)),
        )

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        own = Phi3Fields(
            sliding_window=cfg.get("sliding_window"),
            partial_rotary_factor=partial,
            original_max_position_embeddings=cfg.get("original_max_position_embeddings"),
            resid_pdrop=cfg.get("resid_pdrop"),
            embd_pdrop=cfg.get("embd_pdrop"),
        )
        return hf_common_config(cfg, self.name, own)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, "phi3", dtype)
        own = cfg.fields(Phi3Fields)
        out["rope_parameters"]["partial_rotary_factor"] = own.partial_rotary_factor
        for key in ("original_max_position_embeddings", "sliding_window", "resid_pdrop", "embd_pdrop"):
            if getattr(own, key) is not None:
                out[key] = getattr(own, key)
        out.update(initializer_range=0.02)
        return out


register(Phi3())
