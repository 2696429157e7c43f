"""Qwen3.5 and Qwen3.5-MoE (Qwen3.6 too): the hybrid text stack (:mod:`ckptkit.models.hybrid`)
with Qwen3.5's four linear-attention input projections (``in_proj_qkv`` / ``z`` / ``b`` /
``a``), interleaved mRoPE, every layer with experts (packed ``mlp.experts.gate_up_proj`` in
the release) in the MoE one. Released as ``...ForConditionalGeneration``: the text model under
``model.language_model.``, a vision tower under ``model.visual.`` (carried as it is, never
dropped), the MTP layer as ``mtp.*``; transformers' ``...ForCausalLM`` layout is read and
written too (``model.``, ``model_type`` ``qwen3_5_text``)."""

from __future__ import annotations

from typing import Any, ClassVar

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.hybrid import (
    Hybrid,
    HybridFields,
    hybrid_config,
    hybrid_fields,
    hybrid_gguf,
    moe_fields,
    text_config,
)
from ckptkit.models.registry import register


class Qwen3_5(Hybrid, Family):
    name = "qwen3_5"
    hf_model_types = ("qwen3_5", "qwen3_5_text")
    hf_architecture = "Qwen3_5ForCausalLM"
    fields: ClassVar[type[HybridFields]] = HybridFields
    split_in_proj = True
    gguf = hybrid_gguf("qwen35", ("Qwen3_5ForCausalLM",), "tiled", moe=False)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        text, wrapper = text_config(cfg)
        moe = moe_fields(text)
        own = self.fields(**moe, dense_layers=[], vl_wrapper=wrapper, experts_layout="stacked")  # as released
        return hybrid_config(text, self.name, own)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        f = cfg.fields(HybridFields)
        out = hybrid_fields(cfg, self, self.hf_model_types[1], dtype, dense=not f.num_experts)
        if f.vl_wrapper is None:
            return out
        for key in ("architectures", "dtype", "rope_theta"):
            out.pop(key)
        return {**f.vl_wrapper, "text_config": out, "dtype": dtype}


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    hf_model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    hf_architecture = "Qwen3_5MoeForCausalLM"
    gguf = hybrid_gguf("qwen35moe", ("Qwen3_5MoeForCausalLM",), "tiled", moe=True)


register(Qwen3_5(), Qwen3_5Moe())
