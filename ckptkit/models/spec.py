"""How a model family names and lays out its tensors in each format.

A family is data: for each native naming scheme (Meta's, HF's) an ordered list of :class:`Rule` (head, per
layer, tail). Each rule ties one native tensor to one or more canonical tensors through
a reversible transform. Config translation lives beside the rules in the family module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckptkit.models.config import FamilyFields, ModelConfig
from ckptkit.tensors.transforms import COPY, TIED, Transform


@dataclass(frozen=True)
class Rule:
    """One native tensor and the canonical tensor(s) it holds.

    kind: the :class:`~ckptkit.tensors.transforms.Transform` relating them (``COPY``, ``ROPE_Q``,
    ``ROPE_K``, ``FUSED``, ``TIED``); reading calls its ``forward``, writing its ``inverse``.
    """

    native: str
    canonical: tuple[str, ...]
    kind: Transform = COPY
    optional: bool = False  # may be absent on read; written only when restoring a layout that has it

    def at(self, layer: int) -> Rule:
        return Rule(
            self.native.format(i=layer), tuple(c.format(i=layer) for c in self.canonical), self.kind, self.optional
        )


@dataclass(frozen=True)
class Layout:
    """Ordered rules of one native format: before the layers, per layer, after."""

    head: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    tail: tuple[Rule, ...] = ()
    unused: tuple[str, ...] = ()  # regexes of native tensors the model does not use

    def expand(self, num_layers: int) -> list[Rule]:
        rules = list(self.head)
        for i in range(num_layers):
            rules += [r.at(i) for r in self.layer]
        return rules + list(self.tail)

    def is_unused(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.unused)


def hf_llama_layout(cfg: ModelConfig, biases: bool = False) -> Layout:
    """The HF ``LlamaForCausalLM`` naming, shared by Llama, Mistral, Qwen2 and Gemma."""
    attn = []
    for p in "qkv":
        attn.append(Rule(f"model.layers.{{i}}.self_attn.{p}_proj.weight", (f"layers.{{i}}.attn.{p}_proj.weight",)))
        if biases:
            attn.append(Rule(f"model.layers.{{i}}.self_attn.{p}_proj.bias", (f"layers.{{i}}.attn.{p}_proj.bias",)))
    layer = (
        *attn,
        Rule("model.layers.{i}.self_attn.o_proj.weight", ("layers.{i}.attn.output_proj.weight",)),
        Rule("model.layers.{i}.mlp.gate_proj.weight", ("layers.{i}.mlp.w1.weight",)),
        Rule("model.layers.{i}.mlp.up_proj.weight", ("layers.{i}.mlp.w3.weight",)),
        Rule("model.layers.{i}.mlp.down_proj.weight", ("layers.{i}.mlp.w2.weight",)),
        Rule("model.layers.{i}.input_layernorm.weight", ("layers.{i}.sa_norm.scale",)),
        Rule("model.layers.{i}.post_attention_layernorm.weight", ("layers.{i}.mlp_norm.scale",)),
    )
    return Layout(
        head=(Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)),),
        layer=layer,
        tail=(Rule("model.norm.weight", ("norm.scale",)), hf_output_rule(cfg)),
        unused=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    )


def hf_output_rule(cfg: ModelConfig) -> Rule:
    """``lm_head.weight``; tied models usually omit it, though old ``.bin`` files store a copy."""
    if cfg.tie_word_embeddings:
        return Rule("lm_head.weight", ("tok_embeddings.weight",), TIED, optional=True)
    return Rule("lm_head.weight", ("output.weight",))


def rope_parameters(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling from an HF config, in the transformers 5 or the older spelling."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = None
    if params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    elif cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
    return float(theta), scaling


def hf_rope_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Rope settings for a written config.json: transformers 5's ``rope_parameters`` plus
    the older top-level ``rope_theta`` / ``rope_scaling`` that other tools still read."""
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        params.update(cfg.rope_scaling)
    out: dict[str, Any] = {"rope_parameters": params, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


def hf_common_config(cfg: dict[str, Any], model_type: str, extra: FamilyFields, **overrides: Any) -> ModelConfig:
    """The ModelConfig fields every HF decoder config spells the same way, with ``extra``, the
    family's own (read by the family)."""
    theta, scaling = rope_parameters(cfg)
    heads = cfg["num_attention_heads"]
    values: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )
    values.update(overrides)
    return ModelConfig(**values, extra=extra)


def hf_common_fields(cfg: ModelConfig, architecture: str, hf_model_type: str, dtype: str) -> dict[str, Any]:
    """config.json fields shared by the HF decoders (transformers 5 spelling)."""
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": hf_model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
    }
    out.update(hf_rope_fields(cfg))
    return out
