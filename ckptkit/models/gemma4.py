"""Gemma 4 (``gemma4``; its text model ``gemma4_text``). What differs from Gemma 3's text model:

* norms scale by ``weight`` (not ``1 + weight``); keys and values are normed too (the value
  norm has no weight); attention scale 1, no ``query_pre_attn_scalar``, no attention soft-capping;
* the full-attention layers have heads of their own size (``global_head_dim``, in config.json
  as ``per_layer_config``), their own KV head count, and with ``attention_k_eq_v`` no
  ``v_proj`` (the keys are the values); their rope is ``proportional`` on part of each head;
* the last ``num_kv_shared_layers`` layers reuse earlier layers' keys and values: no
  ``k_proj`` / ``v_proj`` / ``k_norm`` of their own, and with ``use_double_wide_mlp`` an MLP
  twice as wide;
* per-layer embeddings (PLE, ``hidden_size_per_layer_input``): ``embed_tokens_per_layer``,
  ``per_layer_model_projection`` and its norm, and per layer an input gate, a projection and
  a norm;
* with ``enable_moe_block``, experts beside the dense MLP in every layer: a router (``proj``,
  ``scale``, ``per_expert_scale``), stacked ``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I] (kept stacked), and three more norms;
* a ``layer_scalar`` per layer (a persistent buffer).

Released as ``Gemma4ForConditionalGeneration``: the text model under ``model.language_model.``,
the vision (and audio) tower and embedders beside it, carried as tensors the text model does
not use (``internal`` and DCP hold them under their HF names). DCP holds ckptkit's canonical
names (torchtitan has no Gemma model) with the HF config.json.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.models.config import Decoder, ModelConfig
from ckptkit.models.deepseek_v3 import Part
from ckptkit.models.family import Family
from ckptkit.models.features import LocalRope, SlidingWindow, SoftCapping
from ckptkit.models.fields import boolean, non_negative_int
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.hybrid import text_config
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields

SLIDING, FULL = "sliding_attention", "full_attention"
# the multimodal release's towers and embedders (HF: under ``model.``): carried, unused by the text model
TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
_KEYS = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn)\.k_proj\.weight")


@dataclass
class Gemma4Fields(SlidingWindow, SoftCapping, LocalRope):
    """What Gemma 4's text config adds to the common fields (see the module docstring).

    Attributes:
        layer_types: ``sliding_attention`` or ``full_attention`` per layer.
        layer_rope: ``rope_parameters`` per layer type, as config.json gives them.
        per_layer_config: the full layers' own ``head_dim`` / ``num_key_value_heads``, as
            config.json gives them (transformers 5.24 and later), by layer index.
        global_head_dim, num_global_key_value_heads: the same, as older config.json files
            give them (None: not given).
        wrapper: the ``Gemma4ForConditionalGeneration`` config.json without its
            ``text_config`` (None: a causal LM).
        towers: the towers' tensors (canonical name, without ``model.`` -> shape), from the
            checkpoint's names; not part of the saved config.
        shared_kv_stored: the checkpoint holds k/v projections and key norms for the
            KV-shared layers too (Google's releases; transformers ignores them), from its names.
    """

    decoder = Decoder(embed_scale=True, post_norms=True, qk_norm="head")
    checks = {
        "hidden_size_per_layer_input": non_negative_int,
        "num_kv_shared_layers": non_negative_int,
        "attention_k_eq_v": boolean,
        "use_double_wide_mlp": boolean,
        "enable_moe_block": boolean,
    }

    layer_types: list[str] = field(default_factory=list)
    layer_rope: dict[str, Any] = field(default_factory=dict)
    per_layer_config: dict[str, Any] | None = None
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int | None = None
    num_kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    gemma4_experts: int | None = None
    top_k_experts: int | None = None
    gemma4_expert_size: int | None = None
    use_bidirectional_attention: str | None = None
    initializer_range: float = 0.02
    wrapper: dict[str, Any] | None = None
    towers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shared_kv_stored: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        del out["towers"], out["shared_kv_stored"]
        return out


def layer_type(cfg: ModelConfig, i: int) -> str:
    """Layer ``i``'s attention kind: as ``layer_types`` says, else transformers' default
    (every sixth layer and the last full)."""
    types = cfg.fields(Gemma4Fields).layer_types
    if i < len(types):
        return types[i]
    return FULL if (i + 1) % 6 == 0 or i == cfg.num_layers - 1 else SLIDING


def layer_attention(cfg: ModelConfig, i: int) -> tuple[int, int]:
    """(head_dim, KV heads) of layer ``i``: the full layers' own where the config gives them."""
    f = cfg.fields(Gemma4Fields)
    if layer_type(cfg, i) != FULL:
        return cfg.head_dim, cfg.num_kv_heads
    if f.per_layer_config is not None:
        own = f.per_layer_config.get(str(i)) or {}
        return int(own.get("head_dim", cfg.head_dim)), int(own.get("num_key_value_heads", cfg.num_kv_heads))
    kv = f.num_global_key_value_heads if f.attention_k_eq_v and f.num_global_key_value_heads else cfg.num_kv_heads
    return f.global_head_dim or 512, kv  # transformers' default global_head_dim


def shares_kv(cfg: ModelConfig, i: int) -> bool:
    """Whether layer ``i`` reuses an earlier layer's keys and values (has no k/v of its own)."""
    return i >= cfg.num_layers - cfg.fields(Gemma4Fields).num_kv_shared_layers


def layer_parts(cfg: ModelConfig, i: int) -> list[Part]:
    """The tensors of layer ``i`` in transformers' module order (torchtitan's names left empty)."""
    f, h = cfg.fields(Gemma4Fields), cfg.hidden_size
    d, kv = layer_attention(cfg, i)
    q = cfg.num_heads * d
    a, parts = "self_attn.", [Part("layer_scalar", "layer_scalar", None, (1,))]

    def proj(hf: str, canon: str, rows: int, cols: int) -> None:
        parts.append(Part(f"{a}{hf}.weight", f"attn.{canon}.weight", None, (rows, cols)))
        if cfg.attention_bias:
            parts.append(Part(f"{a}{hf}.bias", f"attn.{canon}.bias", None, (rows,)))

    proj("q_proj", "q_proj", q, h)
    parts.append(Part(a + "q_norm.weight", "attn.q_norm.scale", None, (d,)))
    if not shares_kv(cfg, i) or f.shared_kv_stored:
        parts.append(Part(a + "k_norm.weight", "attn.k_norm.scale", None, (d,)))
        proj("k_proj", "k_proj", kv * d, h)
        if not (f.attention_k_eq_v and layer_type(cfg, i) == FULL):
            proj("v_proj", "v_proj", kv * d, h)
    proj("o_proj", "output_proj", h, q)
    inter = cfg.intermediate_size * (2 if f.use_double_wide_mlp and shares_kv(cfg, i) else 1)
    parts += [
        Part("mlp.gate_proj.weight", "mlp.w1.weight", None, (inter, h)),
        Part("mlp.up_proj.weight", "mlp.w3.weight", None, (inter, h)),
        Part("mlp.down_proj.weight", "mlp.w2.weight", None, (h, inter)),
    ]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    canon = ("sa_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")
    parts += [Part(f"{n}.weight", f"{c}.scale", None, (h,)) for n, c in zip(norms, canon, strict=True)]
    if p := f.hidden_size_per_layer_input:
        parts += [
            Part("per_layer_input_gate.weight", "ple.gate.weight", None, (p, h)),
            Part("per_layer_projection.weight", "ple.proj.weight", None, (h, p)),
            Part("post_per_layer_input_norm.weight", "ple.norm.scale", None, (h,)),
        ]
    if f.enable_moe_block:
        e, m = int(f.gemma4_experts or 0), int(f.gemma4_expert_size or 0)
        parts += [
            Part("router.scale", "moe.router.scale", None, (h,)),
            Part("router.per_expert_scale", "moe.router.per_expert_scale", None, (e,)),
            Part("router.proj.weight", "moe.router.weight", None, (e, h)),
            Part("experts.gate_up_proj", "moe.experts.gate_up_proj", None, (e, 2 * m, h)),
            Part("experts.down_proj", "moe.experts.down_proj", None, (e, h, m)),
            Part("post_feedforward_layernorm_1.weight", "mlp_post_norm_1.scale", None, (h,)),
            Part("post_feedforward_layernorm_2.weight", "moe_post_norm.scale", None, (h,)),
            Part("pre_feedforward_layernorm_2.weight", "moe_norm.scale", None, (h,)),
        ]
    return parts


def head_parts(cfg: ModelConfig) -> list[Part]:
    """The tensors outside the layers: embeddings, per-layer embeddings, final norm."""
    f, h = cfg.fields(Gemma4Fields), cfg.hidden_size
    parts = [Part("embed_tokens.weight", "tok_embeddings.weight", None, (cfg.vocab_size, h))]
    parts.append(Part("norm.weight", "norm.scale", None, (h,)))
    if p := f.hidden_size_per_layer_input:
        rows, width = int(f.vocab_size_per_layer_input or cfg.vocab_size), cfg.num_layers * p
        parts += [
            Part("embed_tokens_per_layer.weight", "ple.tok_embeddings.weight", None, (rows, width)),
            Part("per_layer_model_projection.weight", "ple.model_proj.weight", None, (width, h)),
            Part("per_layer_projection_norm.weight", "ple.norm.scale", None, (p,)),
        ]
    return parts


# llama.cpp's Gemma4Model: Gemma3Model's keys (TextModel's, rewritten in place), then its own
_GEMMA4 = (
    "block_count", "context_length?", "embedding_length", "feed_forward_length_per_layer", "head_count",
    "head_count_kv_per_layer", "rope_scaling", "rope_freq_base?", "rope_freq_base_swa?", "layer_norm_rms_eps?",
    "expert_count_given?", "expert_used_count_given?", "head_dim_full", "file_type", "final_logit_softcapping?",
    "sliding_window", "shared_kv_layers", "embedding_length_per_layer_input", "sliding_window_pattern",
    "head_dim_swa", "expert_feed_forward_length_given?", "rope_dimension_count_per_kind",
)  # fmt: skip
GEMMA4_GGUF = GGUFSpec(
    "gemma4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    _GEMMA4,
    "gemma4",
    embeddings_to_vocab=True,
    renames=(
        ("layer_scalar", "layer_output_scale.weight"),
        ("router.scale", "ffn_gate_inp.scale"),
        ("router.per_expert_scale", "ffn_down_exps.scale"),
        ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
        ("experts.down_proj", "ffn_down_exps.weight"),
    ),
    skipped=TOWERS,
    proportional_rope=True,
)


class Gemma4(Family):
    name = "gemma4"
    hf_model_types = ("gemma4_text", "gemma4")
    hf_architecture = "Gemma4ForCausalLM"
    fields: ClassVar[type[Gemma4Fields]] = Gemma4Fields
    gguf = GEMMA4_GGUF

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = {p.canonical: p.shape for p in head_parts(cfg)}
        for i in range(cfg.num_layers):
            shapes |= {f"layers.{i}.{p.canonical}": p.shape for p in layer_parts(cfg, i)}
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
        return shapes | cfg.fields(Gemma4Fields).towers

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        wrapped = cfg.fields(Gemma4Fields).wrapper is not None
        m = "model.language_model." if wrapped else "model."
        rules = [Rule(m + p.hf, (p.canonical,)) for p in head_parts(cfg)]
        for i in range(cfg.num_layers):
            rules += [Rule(f"{m}layers.{i}.{p.hf}", (f"layers.{i}.{p.canonical}",)) for p in layer_parts(cfg, i)]
        if not cfg.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("output.weight",)))
        rules += [Rule("model." + name, (name,)) for name in cfg.fields(Gemma4Fields).towers]
        return Layout(tuple(rules), (), (), unused=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout:
        """The canonical names (torchtitan has no Gemma model), the towers' beside them."""
        return Layout(tuple(Rule(n, (n,)) for n in self.canonical_shapes(cfg)), ())

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """Its HF config.json (the wrapper's, towers' configs included)."""
        return "config.json", self.config_to_hf(cfg, dtype)

    def layer_names(self, cfg: ModelConfig, names: Iterable[str]) -> list[str]:
        """The text layers' names (not the towers', which have ``layers.N`` of their own)."""
        return [n for n in names if not n.removeprefix("model.").startswith(TOWERS)]

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        """The towers the checkpoint holds (``names``: its tensor infos, whose shapes give
        theirs), and whether it holds the KV-shared layers' k/v projections."""
        infos = names if isinstance(names, Mapping) else {}
        towers, stored = {}, False
        for n in names:
            if (canonical := n.removeprefix("model.")).startswith(TOWERS):
                towers[canonical] = tuple(infos[n].shape) if n in infos else ()
            elif (m := _KEYS.search(n)) and shares_kv(cfg, int(m.group(1))):
                stored = True
        return cfg.replace_fields(towers=towers, shared_kv_stored=stored)

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        window = cfg.fields(Gemma4Fields).sliding_window
        return [window if layer_type(cfg, i) == SLIDING else None for i in range(cfg.num_layers)]

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        text, wrapper = text_config(cfg)
        layers = int(text["num_hidden_layers"])
        types = text.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
            raise CkptkitError(
                f"config.json: layer_types must list {SLIDING} or {FULL} for each of the {layers} layers"
            )
        rope = text.get("rope_parameters") or {}
        if not all(isinstance(rope.get(k, {}), dict) for k in (SLIDING, FULL)):
            raise CkptkitError("config.json: rope_parameters must give one object per layer type (Gemma 4)")
        per_layer = text.get("per_layer_config")
        if per_layer is not None and not isinstance(per_layer, dict):
            raise CkptkitError("config.json: per_layer_config must be an object of layer index -> fields")
        own = self.fields(
            sliding_window=text.get("sliding_window"),
            final_logit_softcapping=text.get("final_logit_softcapping"),
            local_rope_theta=float((rope.get(SLIDING) or {}).get("rope_theta", 10000.0)),
            layer_types=list(types),
            layer_rope=dict(rope),
            per_layer_config=per_layer,
            global_head_dim=text.get("global_head_dim"),
            num_global_key_value_heads=text.get("num_global_key_value_heads"),
            hidden_size_per_layer_input=int(text.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=text.get("vocab_size_per_layer_input"),
            num_kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
            attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
            use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
            enable_moe_block=bool(text.get("enable_moe_block", False)),
            gemma4_experts=text.get("num_experts"),
            top_k_experts=text.get("top_k_experts"),
            gemma4_expert_size=text.get("moe_intermediate_size"),
            use_bidirectional_attention=text.get("use_bidirectional_attention"),
            initializer_range=float(text.get("initializer_range", 0.02)),
            wrapper=wrapper,
        )
        if own.num_kv_shared_layers > layers:
            raise CkptkitError(f"config.json: num_kv_shared_layers {own.num_kv_shared_layers} > {layers} layers")
        if own.enable_moe_block and not (own.gemma4_experts and own.gemma4_expert_size):
            raise CkptkitError("config.json: enable_moe_block needs num_experts and moe_intermediate_size")
        full = rope.get(FULL) or {}
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        return hf_common_config(
            {**text, "rope_parameters": full},
            self.name,
            own,
            hidden_act=text.get("hidden_activation") or "gelu_pytorch_tanh",
            tie_word_embeddings=bool(tie),
        )

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        f = cfg.fields(Gemma4Fields)
        out = hf_common_fields(cfg, self.hf_architecture, "gemma4_text", dtype)
        for key in ("hidden_act", "rope_theta", "rope_scaling"):
            out.pop(key, None)
        out.update(
            attention_bias=cfg.attention_bias,
            attention_k_eq_v=f.attention_k_eq_v,
            enable_moe_block=f.enable_moe_block,
            final_logit_softcapping=f.final_logit_softcapping,
            hidden_activation=cfg.hidden_act,
            hidden_size_per_layer_input=f.hidden_size_per_layer_input,
            initializer_range=f.initializer_range,
            layer_types=f.layer_types,
            moe_intermediate_size=f.gemma4_expert_size,
            num_experts=f.gemma4_experts,
            num_kv_shared_layers=f.num_kv_shared_layers,
            rope_parameters=f.layer_rope,
            sliding_window=f.sliding_window,
            top_k_experts=f.top_k_experts,
            use_bidirectional_attention=f.use_bidirectional_attention,
            use_double_wide_mlp=f.use_double_wide_mlp,
            vocab_size_per_layer_input=f.vocab_size_per_layer_input,
        )
        for key in ("per_layer_config", "global_head_dim", "num_global_key_value_heads"):
            if getattr(f, key) is not None:
                out[key] = getattr(f, key)
        out = dict(sorted(out.items()))
        if f.wrapper is None:
            return out
        out.pop("architectures")
        return dict(sorted({**f.wrapper, "text_config": out, "dtype": dtype}.items()))


register(Gemma4())
