"""Gemma 3 (text): Gemma 2's four norms per layer plus per-head ``q_norm``/``k_norm``, no
soft-capping by default, and sliding-window layers with their own rope base
(``rope_parameters`` per layer type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.features import LocalRope
from ckptkit.models.gemma2 import Gemma2, Gemma2Fields
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.qwen3 import qk_norm_rules
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout

# llama.cpp's Gemma3Model: TextModel's keys (rewritten in place with its defaults), then these
_GEMMA3 = (
    "block_count", "context_length?", "embedding_length", "feed_forward_length", "head_count", "head_count_kv?",
    "rope_scaling", "rope_freq_base?", "rope_freq_base_swa?", "layer_norm_rms_eps?", "head_dim?", "file_type",
    "final_logit_softcapping?", "sliding_window",
)  # fmt: skip
GEMMA3_GGUF = GGUFSpec(
    "gemma3",
    ("Gemma3ForCausalLM",),
    _GEMMA3,
    "spm_unprefixed_or_bpe",
    norm_plus_one=True,
    sliding_pattern=6,
    query_scale_layers=(62,),
    embeddings_to_vocab=True,
)


@dataclass
class Gemma3Fields(Gemma2Fields, LocalRope):
    """Gemma 2's fields and a rope base of the sliding layers' own; q/k norms per head."""

    decoder = Decoder(norm_plus_one=True, embed_scale=True, post_norms=True, qk_norm="head")


class Gemma3Text(Gemma2):
    name = "gemma3_text"
    hf_model_types = ("gemma3_text",)
    hf_architecture = "Gemma3ForCausalLM"
    fields: ClassVar[type[Gemma3Fields]] = Gemma3Fields
    sliding_pattern = 6
    gguf = GEMMA3_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = super().hf_layout(cfg)
        o = 1 + next(j for j, r in enumerate(base.layer) if r.native.endswith("o_proj.weight"))
        return Layout(base.head, base.layer[:o] + qk_norm_rules() + base.layer[o:], base.tail, base.unused)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        params = cfg.get("rope_parameters") or {}
        full = params.get("full_attention")
        local = params.get("sliding_attention")
        flat = dict(cfg)
        if isinstance(full, dict):  # transformers 5: one rope_parameters per layer type
            flat["rope_parameters"] = full
        model = super().config_from_hf(flat)
        local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        return model.replace_fields(local_rope_theta=float(local_theta))

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = super().config_to_hf(cfg, dtype)
        full = out["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": cfg.fields(Gemma3Fields).local_rope_theta or 10000.0}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        out.pop("rope_theta", None)
        out.pop("rope_scaling", None)
        out.update(use_bidirectional_attention=False)
        return out


register(Gemma3Text())
