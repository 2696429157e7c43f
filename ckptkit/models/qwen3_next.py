"""Qwen3-Next: the hybrid text stack (:mod:`ckptkit.models.hybrid`) as a causal LM, linear
attention input projections fused (``in_proj_qkvz``, ``in_proj_ba``), norms stored as
scale - 1 (``x * (1 + w)``), dense layers where ``mlp_only_layers`` says and experts one
tensor per expert in the release, the MTP layer as ``mtp.*``."""

from __future__ import annotations

from typing import Any, ClassVar

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.hybrid import Hybrid, HybridFields, hybrid_config, hybrid_fields, hybrid_gguf, moe_fields
from ckptkit.models.registry import register


class Qwen3Next(Hybrid, Family):
    name = "qwen3_next"
    hf_model_types = ("qwen3_next",)
    hf_architecture = "Qwen3NextForCausalLM"
    fields: ClassVar[type[HybridFields]] = HybridFields
    gguf = hybrid_gguf("qwen3next", ("Qwen3NextForCausalLM",), "fused", moe=True)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        moe = moe_fields(cfg)
        layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in only or not (moe["num_experts"] > 0 and (i + 1) % step == 0)]
        return hybrid_config(cfg, self.name, self.fields(**moe, dense_layers=dense))

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hybrid_fields(cfg, self, self.hf_model_types[0], dtype, dense=True)
        f = cfg.fields(HybridFields)
        out.update(decoder_sparse_step=1, mlp_only_layers=list(f.dense_layers or []), norm_topk_prob=f.norm_topk_prob)
        return out


register(Qwen3Next())
