"""DeepSeek V3 (also R1, V3.1 and Kimi K2, same architecture): multi-head latent attention
(queries through a low-rank ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, or one ``q_proj``
when ``q_lora_rank`` is null; keys and values through ``kv_a_proj_with_mqa`` /
``kv_a_layernorm`` / ``kv_b_proj``), ``first_k_dense_replace`` dense layers then experts with
shared experts and a router bias (``e_score_correction_bias``), and the multi-token-prediction
(MTP) layers DeepSeek's release stores at ``model.layers.{num_hidden_layers + j}``.

The MTP layers are carried in every format (canonical ``mtp.{j}.`` + their HF names past the
layer index); a checkpoint without them (most fine-tunes) has none to carry. DCP holds
torchtitan's names (its DeepSeek V3 state-dict adapter: ``attention.wkv_a``, ``moe.experts.w1``
stacked, ``moe.expert_bias``), the MTP layers under their canonical names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.fields import boolean, non_negative_int, optional, positive_float, positive_int
from ckptkit.models.gguf_spec import GGUFExperts, GGUFSpec
from ckptkit.models.moe import MoEFields, expert_rules, expert_size, experts_layout_of
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_output_rule
from ckptkit.tensors.transforms import STACKED

MTP_PREFIX = "mtp."
_HF_LAYER = re.compile(r"(?:model\.layers|blk)\.(\d+)\..+")  # blk: GGUF, NextN layers as blocks


@dataclass
class SharedExpertsFields(MoEFields):
    """Experts with shared experts and a grouped, scaled, biased router, and the MTP layers past
    ``num_hidden_layers`` (DeepSeek V3, GLM-4.5).

    Attributes:
        mtp_stored: whether the checkpoint holds its ``num_nextn_predict_layers`` MTP layers
            (from its tensor names).
    """

    checks = {
        "n_shared_experts": optional(non_negative_int),
        "n_group": optional(positive_int),
        "topk_group": optional(positive_int),
        "routed_scaling_factor": positive_float,
        "num_nextn_predict_layers": optional(non_negative_int),
    }

    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    mtp_stored: bool = True


@dataclass
class DeepseekV3Fields(SharedExpertsFields):
    """Latent attention ranks and head dims, besides the experts and MTP layers.

    Attributes:
        q_lora_rank: the queries' low rank (None: one ``q_proj``).
    """

    checks = {
        "q_lora_rank": optional(positive_int),
        "kv_lora_rank": positive_int,
        "qk_nope_head_dim": positive_int,
        "qk_rope_head_dim": positive_int,
        "v_head_dim": positive_int,
        "rope_interleave": boolean,
    }

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True


class Part(NamedTuple):
    """One tensor of a layer: its HF, canonical and torchtitan names past the layer prefix
    (torchtitan's None: among the experts it stacks) and its shape."""

    hf: str
    canonical: str
    titan: str | None
    shape: tuple[int, ...]


def layer_parts(cfg: ModelConfig, moe: bool) -> list[Part]:
    """The tensors of one layer (dense or with experts), in module order, experts one tensor each."""
    f = cfg.fields(DeepseekV3Fields)
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = f.qk_nope_head_dim + f.qk_rope_head_dim
    kv_a = f.kv_lora_rank + f.qk_rope_head_dim
    a = "self_attn."
    parts: list[Part] = []
    if f.q_lora_rank:
        parts.append(Part(a + "q_a_proj.weight", "attn.q_a_proj.weight", "attention.wq_a.weight", (f.q_lora_rank, h)))
        if cfg.attention_bias:
            parts.append(Part(a + "q_a_proj.bias", "attn.q_a_proj.bias", "attention.wq_a.bias", (f.q_lora_rank,)))
        parts += [
            Part(a + "q_a_layernorm.weight", "attn.q_a_norm.scale", "attention.q_norm.weight", (f.q_lora_rank,)),
            Part(a + "q_b_proj.weight", "attn.q_b_proj.weight", "attention.wq_b.weight", (heads * qk, f.q_lora_rank)),
        ]
    else:
        parts.append(Part(a + "q_proj.weight", "attn.q_proj.weight", "attention.wq.weight", (heads * qk, h)))
    parts.append(Part(a + "kv_a_proj_with_mqa.weight", "attn.kv_a_proj.weight", "attention.wkv_a.weight", (kv_a, h)))
    if cfg.attention_bias:
        parts.append(Part(a + "kv_a_proj_with_mqa.bias", "attn.kv_a_proj.bias", "attention.wkv_a.bias", (kv_a,)))
    kv_b = heads * (f.qk_nope_head_dim + f.v_head_dim)
    parts += [
        Part(a + "kv_a_layernorm.weight", "attn.kv_a_norm.scale", "attention.kv_norm.weight", (f.kv_lora_rank,)),
        Part(a + "kv_b_proj.weight", "attn.kv_b_proj.weight", "attention.wkv_b.weight", (kv_b, f.kv_lora_rank)),
        Part(a + "o_proj.weight", "attn.output_proj.weight", "attention.wo.weight", (h, heads * f.v_head_dim)),
    ]
    return parts + mlp_parts(cfg, moe)


def mlp_parts(cfg: ModelConfig, moe: bool) -> list[Part]:
    """The MLP (experts one tensor each, shared experts, router and its bias; or dense) and the
    two norms of a layer."""
    f = cfg.fields(SharedExpertsFields)
    h = cfg.hidden_size
    parts: list[Part] = []
    if moe:
        inter, shared = expert_size(cfg), expert_size(cfg) * f.n_shared_experts
        for e in range(f.num_experts):
            for hf, w, shape in (("gate_proj", "w1", (inter, h)), ("up_proj", "w3", (inter, h))):
                parts.append(Part(f"mlp.experts.{e}.{hf}.weight", f"mlp.experts.{e}.{w}.weight", None, shape))
            parts.append(Part(f"mlp.experts.{e}.down_proj.weight", f"mlp.experts.{e}.w2.weight", None, (h, inter)))
        parts += [
            Part("mlp.gate.weight", "mlp.router.weight", "moe.router.gate.weight", (f.num_experts, h)),
            Part("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", "moe.expert_bias", (f.num_experts,)),
        ]
        if shared:
            for hf, w, shape in (("gate", "w1", (shared, h)), ("up", "w3", (shared, h)), ("down", "w2", (h, shared))):
                titan = f"moe.shared_experts.{w}.weight"
                parts.append(Part(f"mlp.shared_experts.{hf}_proj.weight", f"mlp.shared.{w}.weight", titan, shape))
    else:
        i = cfg.intermediate_size
        parts += [
            Part("mlp.gate_proj.weight", "mlp.w1.weight", "feed_forward.w1.weight", (i, h)),
            Part("mlp.up_proj.weight", "mlp.w3.weight", "feed_forward.w3.weight", (i, h)),
            Part("mlp.down_proj.weight", "mlp.w2.weight", "feed_forward.w2.weight", (h, i)),
        ]
    return parts + [
        Part("input_layernorm.weight", "sa_norm.scale", "attention_norm.weight", (h,)),
        Part("post_attention_layernorm.weight", "mlp_norm.scale", "ffn_norm.weight", (h,)),
    ]


LayerParts = Callable[[ModelConfig, bool], list[Part]]


def mtp_parts(cfg: ModelConfig, layer: LayerParts = layer_parts) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of one MTP layer as HF names them past ``model.layers.{N + j}.``, with shapes:
    its embedding, the two norms and projection that join it to the last hidden state, a
    decoder layer with experts (one tensor each), and its own head."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head = [("embed_tokens.weight", (v, h)), ("enorm.weight", (h,)), ("hnorm.weight", (h,))]
    head.append(("eh_proj.weight", (h, 2 * h)))
    tail = [("shared_head.norm.weight", (h,)), ("shared_head.head.weight", (v, h))]
    return head + [(p.hf, p.shape) for p in layer(cfg, True)] + tail


def mtp_layers(cfg: ModelConfig) -> int:
    """How many MTP layers the checkpoint holds."""
    f = cfg.fields(SharedExpertsFields)
    return f.num_nextn_predict_layers if f.mtp_stored else 0


def mtp_rules(cfg: ModelConfig, native: str, layer: LayerParts = layer_parts) -> tuple[Rule, ...]:
    """The MTP tensors under ``native`` (``{j}`` the MTP layer) and their canonical names."""
    rules = []
    for j in range(mtp_layers(cfg)):
        for name, _ in mtp_parts(cfg, layer):
            rules.append(Rule(native.format(j=j, n=cfg.num_layers + j) + name, (f"{MTP_PREFIX}{j}.{name}",)))
    return tuple(rules)


def is_moe(cfg: ModelConfig, layer: int) -> bool:
    return cfg.fields(SharedExpertsFields).is_moe_layer(layer)


# llama.cpp's DeepseekV2Model: TextModel's keys (one KV head: latent attention as MQA), then its own
DEEPSEEK2_GGUF = GGUFSpec(
    "deepseek2",
    ("DeepseekV3ForCausalLM",),
    (
        "block_count",
        "context_length?",
        "embedding_length",
        "feed_forward_length",
        "head_count",
        "head_count_kv_mla",
        "rope_scaling",
        "rope_freq_base?",
        "layer_norm_rms_eps?",
        "expert_count",
        "expert_used_count",
        "expert_group_count?",
        "expert_group_used_count?",
        "expert_gating_func?",
        "head_dim_mla",
        "file_type",
        "leading_dense_block_count",
        "vocab_size",
        "q_lora_rank?",
        "kv_lora_rank",
        "mla_lengths",
        "expert_feed_forward_length_mla",
        "expert_shared_count",
        "expert_weights_scale?",
        "expert_weights_norm?",
        "rope_dimension_count_mla",
        "yarn_log_multiplier?",
    ),
    "bpe",
    experts=GGUFExperts(("w2", "w1", "w3")),
    latent_attention=True,
)


class DeepseekV3(Family):
    name = "deepseek_v3"
    hf_model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3", "kimi_k2")
    hf_architecture = "DeepseekV3ForCausalLM"
    fields: ClassVar[type[DeepseekV3Fields]] = DeepseekV3Fields
    gguf = DEEPSEEK2_GGUF

    def sample_configs(self) -> list[ModelConfig]:
        """A dense layer, then one with two experts and a shared expert; queries through one
        ``q_proj`` or (DeepSeek) a low-rank pair."""
        cfg = super().sample_configs()[0].replace_fields(num_experts=2, num_experts_per_tok=1, dense_layers=[0])
        cfg = dataclasses.replace(cfg, num_layers=2)
        return [cfg, cfg.replace_fields(q_lora_rank=2)] if cfg.feature(DeepseekV3Fields) else [cfg]

    def layer_parts(self, cfg: ModelConfig, moe: bool) -> list[Part]:
        """The tensors of one layer, dense or with experts."""
        return layer_parts(cfg, moe)

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.hidden_size)}
        for i in range(cfg.num_layers):
            shapes.update({f"layers.{i}.{p.canonical}": p.shape for p in self.layer_parts(cfg, is_moe(cfg, i))})
        shapes["norm.scale"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
        for j in range(mtp_layers(cfg)):
            shapes.update({f"{MTP_PREFIX}{j}.{name}": shape for name, shape in mtp_parts(cfg, self.layer_parts)})
        return shapes

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        rules = [Rule("model.embed_tokens.weight", ("tok_embeddings.weight",))]
        for i in range(cfg.num_layers):
            p, c = f"model.layers.{i}.", f"layers.{i}."
            parts = self.layer_parts(cfg, is_moe(cfg, i))
            experts = [j for j, part in enumerate(parts) if part.titan is None]
            for j, part in enumerate(parts):
                if j in experts[:1]:
                    router = p + "mlp.gate.weight"
                    names = ("gate_proj", "up_proj", "down_proj")
                    rules += expert_rules(cfg, i, p + "mlp.", names, router, p + "mlp.")[1:]
                if j not in experts:
                    rules.append(Rule(p + part.hf, (c + part.canonical,)))
        rules += [Rule("model.norm.weight", ("norm.scale",)), hf_output_rule(cfg)]
        rules += mtp_rules(cfg, "model.layers.{n}.", self.layer_parts)
        return Layout(tuple(rules), (), (), unused=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout:
        """torchtitan's names (its 2026 ones if ``titan``: ``lm_head``, ``moe.expert_bias_E``):
        experts stacked per projection, [E, rows, cols]."""
        rules = [Rule("tok_embeddings.weight", ("tok_embeddings.weight",))]
        n = cfg.fields(SharedExpertsFields).num_experts
        for i in range(cfg.num_layers):
            c = f"layers.{i}."
            for part in self.layer_parts(cfg, is_moe(cfg, i)):
                if part.titan is not None:
                    native = part.titan + ("_E" if titan and part.titan == "moe.expert_bias" else "")
                    rules.append(Rule(c + native, (c + part.canonical,)))
                elif part.canonical.endswith("experts.0.w1.weight"):
                    for w in ("w1", "w3", "w2"):
                        stacked = tuple(f"{c}mlp.experts.{e}.{w}.weight" for e in range(n))
                        rules.append(Rule(f"{c}moe.experts.{w}", stacked, STACKED))
        rules += [
            Rule("norm.weight", ("norm.scale",)),
            Rule("lm_head.weight" if titan else "output.weight", ("output.weight",)),
        ]
        rules += mtp_rules(cfg, MTP_PREFIX + "{j}.", self.layer_parts)
        return Layout(tuple(rules), ())

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """Its HF config.json: torchtitan keeps no config of its own in a checkpoint."""
        return "config.json", self.config_to_hf(cfg, dtype)

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        names = list(names)
        mtp = re.compile(rf"(model\.layers\.{cfg.num_layers}|blk\.{cfg.num_layers}|{re.escape(MTP_PREFIX)}0)\..+")
        cfg = cfg.replace_fields(mtp_stored=any(mtp.fullmatch(n) for n in names))
        return experts_layout_of(cfg, self.layer_names(cfg, names))

    def layer_names(self, cfg: ModelConfig, names: Iterable[str]) -> list[str]:
        """All but the MTP layers' (HF ``model.layers.{N + j}``, GGUF ``blk.{N + j}``)."""
        return [n for n in names if not ((m := _HF_LAYER.fullmatch(n)) and int(m.group(1)) >= cfg.num_layers)]

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        experts = int(cfg.get("n_routed_experts") or 0)
        layers = int(cfg["num_hidden_layers"])
        dense = int(cfg.get("first_k_dense_replace") or 0) if experts else layers
        own = self.fields(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=0.0,
            dense_layers=list(range(min(dense, layers))),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(cfg.get("v_head_dim", 128)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )
        return hf_common_config(cfg, self.name, own, head_dim=own.qk_rope_head_dim)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        f = cfg.fields(DeepseekV3Fields)
        out.update(
            attention_bias=cfg.attention_bias,
            first_k_dense_replace=len(f.dense_layers or []),
            initializer_range=0.02,
            kv_lora_rank=f.kv_lora_rank,
            moe_intermediate_size=expert_size(cfg),
            n_group=f.n_group,
            n_routed_experts=f.num_experts,
            n_shared_experts=f.n_shared_experts,
            norm_topk_prob=f.norm_topk_prob,
            num_experts_per_tok=f.num_experts_per_tok,
            num_nextn_predict_layers=f.num_nextn_predict_layers,
            output_router_logits=False,
            pretraining_tp=1,
            q_lora_rank=f.q_lora_rank,
            qk_head_dim=f.qk_nope_head_dim + f.qk_rope_head_dim,
            qk_nope_head_dim=f.qk_nope_head_dim,
            qk_rope_head_dim=f.qk_rope_head_dim,
            rope_interleave=f.rope_interleave,
            routed_scaling_factor=f.routed_scaling_factor,
            topk_group=f.topk_group,
            v_head_dim=f.v_head_dim,
        )
        return out


register(DeepseekV3())
