"""The hybrid text stack of Qwen3-Next and Qwen3.5 (dense and MoE), shared by their families:
Gated DeltaNet linear attention (``linear_attn.*``) in most layers, gated full attention
(``self_attn.q_proj`` holds each head's query then its output gate; per-head q/k norms) in
the layers ``layer_types`` names ``full_attention``, a dense MLP or experts with a shared
expert and its gate, and the multi-token-prediction (MTP) layers stored as ``mtp.*``.

Canonical names: ``layers.{i}.linear_attn.*`` as HF names them (``norm.scale`` for the
gated norm), ``layers.{i}.attn.{q,k,v}_proj`` / ``output_proj`` / ``{q,k}_norm.scale``,
``mlp.w1/w3/w2`` or ``mlp.router`` + ``mlp.experts.{e}.w1/w3/w2`` + ``mlp.shared.w1/w3/w2``
+ ``mlp.shared_gate``; the MTP layers the same under ``mtp.layers.{j}.`` beside
``mtp.fc.weight``, ``mtp.norm.scale``, ``mtp.embedding_norm.scale`` and ``mtp.hidden_norm.scale``.
DCP holds the canonical names (torchtitan has none of these models) and the HF config.json.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptkit.errors import CkptkitError
from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.fields import check_config_fields, non_negative_int, optional, positive_float, positive_int
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.moe import MoEFields, expert_rules, expert_size, experts_layout_of
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields

LINEAR, FULL = "linear_attention", "full_attention"
MTP = "mtp."
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\..+")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")  # a GGUF's: the MTP layers are the blocks past the text layers
VISION = "visual."  # the vision tower of the multimodal releases (HF: under ``model.``), carried as it is


@dataclass
class HybridFields(MoEFields):
    """Linear attention sizes, the kind of each layer, the shared expert, the partial
    (multimodal) rope and the MTP layers.

    Attributes:
        layer_types: ``linear_attention`` or ``full_attention`` per layer.
        mtp_num_hidden_layers: the config's MTP layer count (None: the config has none).
        mtp_layers: the MTP layers the checkpoint holds (from its tensor names).
        vl_wrapper: the ``...ForConditionalGeneration`` config.json without its
            ``text_config`` (None: a causal LM). Not ``multimodal``: Llama 4's fields
            have a boolean of that name, and a field name has one check in ckptkit.json.
        vision: the vision tower's tensors (canonical ``visual.*`` name -> shape), from the
            checkpoint's names; not part of the saved config.
    """

    decoder = Decoder(norm_plus_one=True, qk_norm="head")
    checks = {
        "linear_conv_kernel_dim": positive_int,
        "linear_key_head_dim": positive_int,
        "linear_value_head_dim": positive_int,
        "linear_num_key_heads": positive_int,
        "linear_num_value_heads": positive_int,
        "shared_expert_intermediate_size": optional(non_negative_int),
        "mtp_num_hidden_layers": optional(non_negative_int),
        "partial_rotary_factor": positive_float,
    }

    layer_types: list[str] = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    shared_expert_intermediate_size: int = 0
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] | None = None
    mrope_interleaved: bool | None = None
    mtp_num_hidden_layers: int | None = None
    mtp_layers: int = 0
    vl_wrapper: dict[str, Any] | None = None
    vision: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        del out["vision"]
        return out

    def kind(self, layer: int) -> str:
        return self.layer_types[layer] if layer < len(self.layer_types) else (FULL if (layer + 1) % 4 == 0 else LINEAR)


def hybrid_gguf(arch: str, architectures: tuple[str, ...], linear_attention: str, moe: bool) -> GGUFSpec:
    """llama.cpp's Qwen3NextModel (``fused``) or a Qwen3.5 subclass of it (``tiled``): the keys
    its set_gguf_parameters writes, in order (block_count counts the MTP layers)."""
    experts = ("expert_count?", "expert_used_count?") if moe else ()
    keys = (
        "block_count_mtp", "context_length?", "embedding_length", "feed_forward_length_given?", "head_count",
        "head_count_kv?", "rope_scaling", "rope_sections", "rope_freq_base?", "layer_norm_rms_eps?", *experts,
        "head_dim?", "file_type", "expert_feed_forward_length?", "expert_shared_feed_forward_length?",
        "mtp_predict_layers?", "ssm", "recurrent_layers?", "full_attention_interval", "rope_dimension_count_hybrid",
    )  # fmt: skip
    if linear_attention == "tiled":
        keys += ("rope_sections_default",)
    return GGUFSpec(arch, architectures, keys, "bpe_or_spm", linear_attention=linear_attention)


class Part(NamedTuple):
    """One tensor of a layer: its HF and canonical names past the layer prefix, and its shape."""

    hf: str
    canonical: str
    shape: tuple[int, ...]


def attention_parts(cfg: ModelConfig, kind: str, split_in_proj: bool) -> list[Part]:
    """A layer's attention tensors, in transformers' order; ``split_in_proj``: Qwen3.5's
    ``in_proj_qkv`` / ``z`` / ``b`` / ``a`` rather than Qwen3-Next's ``in_proj_qkvz`` / ``ba``."""
    f, h = cfg.fields(HybridFields), cfg.hidden_size
    if kind == FULL:
        q, kv, hd, a = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim, "self_attn."
        return [
            Part(a + "q_proj.weight", "attn.q_proj.weight", (2 * q, h)),  # queries and their output gates
            Part(a + "k_proj.weight", "attn.k_proj.weight", (kv, h)),
            Part(a + "v_proj.weight", "attn.v_proj.weight", (kv, h)),
            Part(a + "o_proj.weight", "attn.output_proj.weight", (h, q)),
            Part(a + "q_norm.weight", "attn.q_norm.scale", (hd,)),
            Part(a + "k_norm.weight", "attn.k_norm.scale", (hd,)),
        ]
    if kind != LINEAR:
        raise CkptkitError(f"{cfg.model_type}: layer type {kind!r}; expected {LINEAR} or {FULL}")
    keys, values, nv = (
        f.linear_num_key_heads * f.linear_key_head_dim,
        f.linear_num_value_heads * f.linear_value_head_dim,
        f.linear_num_value_heads,
    )
    a = "linear_attn."
    head = [
        Part(a + "dt_bias", a + "dt_bias", (nv,)),
        Part(a + "A_log", a + "A_log", (nv,)),
        Part(a + "conv1d.weight", a + "conv1d.weight", (2 * keys + values, 1, f.linear_conv_kernel_dim)),
    ]
    tail = [Part(a + "norm.weight", a + "norm.scale", (f.linear_value_head_dim,))]
    tail.append(Part(a + "out_proj.weight", a + "out_proj.weight", (h, values)))
    if not split_in_proj:
        proj = [(a + "in_proj_qkvz.weight", (2 * keys + 2 * values, h)), (a + "in_proj_ba.weight", (2 * nv, h))]
        return head + [Part(n, n, s) for n, s in proj] + tail
    proj = [(a + "in_proj_qkv.weight", (2 * keys + values, h)), (a + "in_proj_z.weight", (values, h))]
    proj += [(a + "in_proj_b.weight", (nv, h)), (a + "in_proj_a.weight", (nv, h))]
    return head + tail + [Part(n, n, s) for n, s in proj]


def mlp_parts(cfg: ModelConfig, moe: bool) -> list[Part]:
    """A layer's MLP tensors but the experts: dense, or router + shared expert + its gate."""
    f, h = cfg.fields(HybridFields), cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return [
            Part("mlp.gate_proj.weight", "mlp.w1.weight", (i, h)),
            Part("mlp.up_proj.weight", "mlp.w3.weight", (i, h)),
            Part("mlp.down_proj.weight", "mlp.w2.weight", (h, i)),
        ]
    s, e = f.shared_expert_intermediate_size, "mlp.shared_expert."
    return [
        Part("mlp.gate.weight", "mlp.router.weight", (f.num_experts, h)),
        Part(e + "gate_proj.weight", "mlp.shared.w1.weight", (s, h)),
        Part(e + "up_proj.weight", "mlp.shared.w3.weight", (s, h)),
        Part(e + "down_proj.weight", "mlp.shared.w2.weight", (h, s)),
        Part("mlp.shared_expert_gate.weight", "mlp.shared_gate.weight", (1, h)),
    ]


NORMS = (("input_layernorm.weight", "sa_norm.scale"), ("post_attention_layernorm.weight", "mlp_norm.scale"))
MTP_PARTS = (
    ("fc.weight", "fc.weight"),
    ("norm.weight", "norm.scale"),
    ("pre_fc_norm_embedding.weight", "embedding_norm.scale"),
    ("pre_fc_norm_hidden.weight", "hidden_norm.scale"),
)


def layer_rules(cfg: ModelConfig, native: str | None, canonical: str, kind: str, moe: bool, split: bool) -> list[Rule]:
    """The rules of one layer (``native`` / ``canonical``: its prefixes; ``native`` None: the
    canonical names themselves), experts in the config's experts layout."""
    if native is None:
        return [Rule(name, (name,)) for name in layer_shapes(cfg, canonical, kind, moe, split)]
    rules = [Rule(native + p.hf, (canonical + p.canonical,)) for p in attention_parts(cfg, kind, split)]
    for p in mlp_parts(cfg, moe):
        rules.append(Rule(native + p.hf, (canonical + p.canonical,)))
        if p.canonical == "mlp.router.weight":
            names = ("gate_proj", "up_proj", "down_proj")
            for r in expert_rules(cfg, 0, native + "mlp.", names, "", native + "mlp.")[1:]:
                rules.append(
                    Rule(r.native, tuple(canonical + c.removeprefix("layers.0.") for c in r.canonical), r.kind)
                )
    return rules + [Rule(native + hf, (canonical + c,)) for hf, c in NORMS]


def layer_shapes(cfg: ModelConfig, canonical: str, kind: str, moe: bool, split: bool) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of one layer's tensors, experts one tensor each."""
    h = cfg.hidden_size
    shapes = {canonical + p.canonical: p.shape for p in attention_parts(cfg, kind, split)}
    for p in mlp_parts(cfg, moe):
        shapes[canonical + p.canonical] = p.shape
        if p.canonical == "mlp.router.weight":
            inter = expert_size(cfg)
            for e in range(cfg.fields(HybridFields).num_experts):
                x = f"{canonical}mlp.experts.{e}."
                shapes |= {x + "w1.weight": (inter, h), x + "w3.weight": (inter, h), x + "w2.weight": (h, inter)}
    return shapes | {canonical + c: (h,) for _, c in NORMS}


class Hybrid:
    """The layouts and config translation of a hybrid family (mixed into its Family class).

    Attributes:
        split_in_proj: Qwen3.5's four linear-attention input projections.
    """

    split_in_proj = False

    def sample_configs(self) -> list[ModelConfig]:
        """A linear and a full layer, the first dense, the second with experts and a shared one."""
        own = self.fields(layer_types=[LINEAR, FULL], num_experts=2, num_experts_per_tok=1, dense_layers=[0])  # type: ignore[attr-defined]
        own.shared_expert_intermediate_size = 2
        return [ModelConfig(self.name, 2, 2, 2, 1, 1, 2, 2, extra=own)]  # type: ignore[attr-defined]

    def is_moe(self, cfg: ModelConfig, layer: int | None) -> bool:
        f = cfg.fields(HybridFields)
        return f.num_experts > 0 and (layer is None or f.is_moe_layer(layer))

    def text_prefix(self, cfg: ModelConfig) -> str:
        return "model.language_model." if cfg.fields(HybridFields).vl_wrapper is not None else "model."

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        f, h, split = cfg.fields(HybridFields), cfg.hidden_size, self.split_in_proj
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, h)}
        for i in range(cfg.num_layers):
            shapes |= layer_shapes(cfg, f"layers.{i}.", f.kind(i), self.is_moe(cfg, i), split)
        shapes["norm.scale"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, h)
        if f.mtp_layers:
            shapes |= {MTP + c: ((h, 2 * h) if c == "fc.weight" else (h,)) for _, c in MTP_PARTS}
        for j in range(f.mtp_layers):
            shapes |= layer_shapes(cfg, f"{MTP}layers.{j}.", FULL, self.is_moe(cfg, None), split)
        return shapes | f.vision

    def layout_rules(self, cfg: ModelConfig, prefix: str, head: str, norm: str, output: str) -> list[Rule]:
        """Every rule: text layers under ``prefix`` (canonical if empty), then the MTP layers."""
        f, split = cfg.fields(HybridFields), self.split_in_proj
        rules = [Rule(head, ("tok_embeddings.weight",))]
        for i in range(cfg.num_layers):
            native = f"{prefix}layers.{i}." if prefix else None
            rules += layer_rules(cfg, native, f"layers.{i}.", f.kind(i), self.is_moe(cfg, i), split)
        rules.append(Rule(norm, ("norm.scale",)))
        if not cfg.tie_word_embeddings:
            rules.append(Rule(output, ("output.weight",)))
        if f.mtp_layers:
            rules += [Rule(MTP + (c if not prefix else hf), (MTP + c,)) for hf, c in MTP_PARTS]
        for j in range(f.mtp_layers):
            p = f"{MTP}layers.{j}."
            rules += layer_rules(cfg, p if prefix else None, p, FULL, self.is_moe(cfg, None), split)
        return rules + [Rule(("model." if prefix else "") + name, (name,)) for name in f.vision]

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        p = self.text_prefix(cfg)
        rules = self.layout_rules(cfg, p, p + "embed_tokens.weight", p + "norm.weight", "lm_head.weight")
        return Layout(tuple(rules), (), (), unused=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout:
        """Canonical names (torchtitan has none of these models)."""
        rules = self.layout_rules(cfg, "", "tok_embeddings.weight", "norm.scale", "output.weight")
        return Layout(tuple(rules), ())

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """Its HF config.json (no other tool has a config of its own for these models)."""
        return "config.json", self.config_to_hf(cfg, dtype)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        raise NotImplementedError

    def layer_names(self, cfg: ModelConfig, names: Iterable[str]) -> list[str]:
        """The text layers' names: not the MTP layers' (GGUF: blocks past the layers) nor the
        vision tower's (``blocks.N``)."""
        return [
            n
            for n in names
            if not n.startswith((MTP, VISION, "model." + VISION))
            and not ((m := _GGUF_BLOCK.match(n)) and int(m.group(1)) >= cfg.num_layers)
        ]

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        """The MTP layers and the vision tower the checkpoint holds (``names``: its tensor
        infos, whose shapes give the vision tower's), and its experts layout."""
        infos = names if isinstance(names, Mapping) else {}
        names = list(names)
        stored = {int(m.group(1)) for n in names if (m := _MTP_LAYER.fullmatch(n))}
        stored |= {int(m.group(1)) - cfg.num_layers for n in names if (m := _GGUF_BLOCK.match(n))}
        stored = {j for j in stored if j >= 0}
        vision = {}
        for n in names:
            canonical = n.removeprefix("model.")
            if canonical.startswith(VISION):
                vision[canonical] = tuple(infos[n].shape) if n in infos else ()
        cfg = cfg.replace_fields(mtp_layers=max(stored) + 1 if stored else 0, vision=vision)
        return experts_layout_of(cfg, self.layer_names(cfg, names))


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the text model's config, the multimodal wrapper's other fields or None) of a config.json."""
    text = cfg.get("text_config")
    if text is None:
        return cfg, None
    if not isinstance(text, dict):
        raise CkptkitError("config.json: text_config must be an object")
    check_config_fields("config.json", text, "config.json text_config")
    return text, {k: v for k, v in cfg.items() if k not in ("text_config", "transformers_version")}


def hybrid_config(cfg: dict[str, Any], name: str, own: HybridFields) -> ModelConfig:
    """The ModelConfig of a hybrid text config, ``own`` completed from it."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {LINEAR, FULL}:
        raise CkptkitError(f"config.json: layer_types must list {LINEAR} or {FULL} for each of the {layers} layers")
    rope = cfg.get("rope_parameters") or {}
    own.layer_types = list(types)
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim"):
        setattr(own, key, int(cfg.get(key, getattr(own, key))))
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        setattr(own, key, int(cfg.get(key, getattr(own, key))))
    own.partial_rotary_factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    own.mrope_section = rope.get("mrope_section")
    own.mrope_interleaved = rope.get("mrope_interleaved")
    own.mtp_num_hidden_layers = cfg.get("mtp_num_hidden_layers")
    if cfg.get("intermediate_size") is None:  # Qwen3.5-MoE's: experts in every layer
        cfg = {**cfg, "intermediate_size": cfg["moe_intermediate_size"]}
    return hf_common_config(cfg, name, own)


def hybrid_fields(cfg: ModelConfig, family: Any, hf_model_type: str, dtype: str, dense: bool) -> dict[str, Any]:
    """The text config.json of ``cfg`` as transformers saves it (``dense``: with ``intermediate_size``)."""
    f = cfg.fields(HybridFields)
    out = hf_common_fields(cfg, family.hf_architecture, hf_model_type, dtype)
    out["rope_parameters"] |= {"partial_rotary_factor": f.partial_rotary_factor}
    if f.mrope_section is not None:
        out["rope_parameters"] |= {"mrope_section": f.mrope_section, "mrope_interleaved": f.mrope_interleaved}
    if not dense:
        del out["intermediate_size"]
    out.update(
        attention_bias=cfg.attention_bias,
        initializer_range=0.02,
        layer_types=f.layer_types,
        linear_conv_kernel_dim=f.linear_conv_kernel_dim,
        linear_key_head_dim=f.linear_key_head_dim,
        linear_value_head_dim=f.linear_value_head_dim,
        linear_num_key_heads=f.linear_num_key_heads,
        linear_num_value_heads=f.linear_num_value_heads,
    )
    if f.mtp_num_hidden_layers is not None:
        out["mtp_num_hidden_layers"] = f.mtp_num_hidden_layers
    if f.num_experts:
        out.update(
            num_experts=f.num_experts,
            num_experts_per_tok=f.num_experts_per_tok,
            moe_intermediate_size=expert_size(cfg),
            shared_expert_intermediate_size=f.shared_expert_intermediate_size,
            router_aux_loss_coef=f.router_aux_loss_coef,
            output_router_logits=False,
        )
    return out


def moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The experts' fields of a hybrid text config (dense: no experts)."""
    return dict(
        num_experts=int(cfg.get("num_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=cfg.get("moe_intermediate_size"),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    )
