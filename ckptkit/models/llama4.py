"""Llama 4 (``llama4``; its text model ``llama4_text``): experts on every
``interleave_moe_layer_step``-th layer (transformers' stacked ``experts.gate_up_proj``
[E, H, 2I] and ``experts.down_proj`` [E, I, H], kept as stored) with a router and a shared
expert, dense layers of ``intermediate_size_mlp`` between them, NoPE layers
(``no_rope_layers``), chunked attention, weightless q/k L2 norms and attention temperature
(config only).

Meta's release is ``Llama4ForConditionalGeneration``: the text model under
``language_model.``, the vision tower (``vision_model.*``) and its projector
(``multi_modal_projector.*``) beside it. Those are carried as tensors the text model does
not use (``internal`` and DCP hold them under their HF names), with the vision config kept
in the written config.json. DCP holds the canonical names.

GGUF is llama.cpp's ``llama4`` (its ``Llama4Model``, for either release): the dense layers'
width as ``feed_forward_length``, the experts' as ``expert_feed_forward_length``, the stacked
experts transposed with ``gate_up_proj`` split in halves, the towers left to ``--mmproj``.
It has no key for the NoPE layers, the chunk size or the attention temperature: llama.cpp
fixes them (:func:`llama_cpp_runs`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckptkit.models.config import ModelConfig
from ckptkit.models.deepseek_v3 import Part
from ckptkit.models.family import Family
from ckptkit.models.fields import boolean, positive_int
from ckptkit.models.gguf_spec import GGUFSpec
from ckptkit.models.moe import MoEFields
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields

# the vision tower and projector of the multimodal release: carried, unused by the text model
VISION = (r"vision_model\..+", r"multi_modal_projector\..+")
_WRAPPER = ("boi_token_index", "eoi_token_index", "image_token_index")
FULL, CHUNKED = "full_attention", "chunked_attention"


@dataclass
class Llama4Fields(MoEFields):
    """The dense layers' MLP size, which layers have experts and rope, the attention settings,
    and for the multimodal release its vision config and wrapper fields.

    Attributes:
        no_rope_layers: per layer, 1 where rope is applied, 0 for a NoPE layer.
        multimodal: the checkpoint is ``Llama4ForConditionalGeneration`` (text under ``language_model.``).
        vision_config: the release's ``vision_config``, as it was.
        wrapper: the multimodal config's own fields (image token ids).
    """

    checks = {
        "intermediate_size_mlp": positive_int,
        "interleave_moe_layer_step": positive_int,
        "use_qk_norm": boolean,
        "attn_temperature_tuning": boolean,
        "multimodal": boolean,
    }

    intermediate_size_mlp: int = 16384
    interleave_moe_layer_step: int = 1
    no_rope_layers: list[int] = field(default_factory=list)
    no_rope_layer_interval: int = 4
    layer_types: list[str] = field(default_factory=list)
    attention_chunk_size: int | None = 8192
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    multimodal: bool = False
    vision_config: dict[str, Any] | None = None
    wrapper: dict[str, Any] = field(default_factory=dict)

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` applies rope: per ``no_rope_layers``, else all but every
        ``no_rope_layer_interval``-th layer (transformers' default)."""
        if self.no_rope_layers:
            return bool(self.no_rope_layers[layer])
        return (layer + 1) % self.no_rope_layer_interval != 0

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of layer ``layer`` (None: full causal attention): per
        ``layer_types``, else the rope layers' when ``attention_chunk_size`` is set."""
        chunked = self.layer_types[layer] == CHUNKED if self.layer_types else self.uses_rope(layer)
        return self.attention_chunk_size if chunked else None


def layer_parts(cfg: ModelConfig, moe: bool) -> list[Part]:
    """The tensors of one layer in module order (torchtitan's names left empty)."""
    f = cfg.fields(Llama4Fields)
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
    parts: list[Part] = []
    for p, n in rows.items():
        parts.append(Part(f"self_attn.{p}_proj.weight", f"attn.{p}_proj.weight", None, (n, h)))
        if cfg.attention_bias:
            parts.append(Part(f"self_attn.{p}_proj.bias", f"attn.{p}_proj.bias", None, (n,)))
    parts.append(Part("self_attn.o_proj.weight", "attn.output_proj.weight", None, (h, rows["q"])))
    if cfg.attention_bias:
        parts.append(Part("self_attn.o_proj.bias", "attn.output_proj.bias", None, (h,)))
    i, e = cfg.intermediate_size, f.num_experts
    if moe:
        parts += [
            Part("feed_forward.experts.gate_up_proj", "mlp.experts.gate_up_proj", None, (e, h, 2 * i)),
            Part("feed_forward.experts.down_proj", "mlp.experts.down_proj", None, (e, i, h)),
            Part("feed_forward.router.weight", "mlp.router.weight", None, (e, h)),
        ]
        ffn, canon = "feed_forward.shared_expert.", "mlp.shared."
    else:
        ffn, canon, i = "feed_forward.", "mlp.", f.intermediate_size_mlp
    parts += [
        Part(ffn + "gate_proj.weight", canon + "w1.weight", None, (i, h)),
        Part(ffn + "up_proj.weight", canon + "w3.weight", None, (i, h)),
        Part(ffn + "down_proj.weight", canon + "w2.weight", None, (h, i)),
        Part("input_layernorm.weight", "sa_norm.scale", None, (h,)),
        Part("post_attention_layernorm.weight", "mlp_norm.scale", None, (h,)),
    ]
    return parts


def llama_cpp_runs(h: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields llama.cpp's ``llama4`` fixes, no GGUF key holding them, for the
    model of config.json ``h``: experts on every ``interleave_moe_layer_step``-th layer, q/k
    L2 norms unless it has 128 experts (Maverick); where every layer is full attention (its
    converter's ``sliding_window`` 0) rope in all of them, else every 4th layer NoPE with full
    attention and an attention temperature (floor 8192, scale 0.1), the others chunked (8192)."""
    n, experts = int(h["num_hidden_layers"]), int(h.get("num_local_experts") or 0)
    step = int(h.get("interleave_moe_layer_step") or 1)
    out: dict[str, Any] = {
        "moe_layers": [i for i in range(n) if experts and (i + 1) % step == 0],
        "use_qk_norm": experts != 128,
    }
    types = h.get("layer_types")
    if types is not None and all(t == FULL for t in types):
        return out | {"no_rope_layers": [1] * n, "layer_types": [FULL] * n}
    rope = [int((i + 1) % 4 != 0) for i in range(n)]
    out |= {"no_rope_layers": rope, "no_rope_layer_interval": 4, "layer_types": [CHUNKED if r else FULL for r in rope]}
    return out | {"attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}


# llama.cpp's Llama4Model: LlamaModel's keys with intermediate_size_mlp as TextModel's
# feed-forward length, then its own
_LLAMA4 = (
    "block_count", "context_length?", "embedding_length", "feed_forward_length_mlp", "head_count", "head_count_kv?",
    "rope_scaling", "rope_freq_base?", "layer_norm_rms_eps?", "expert_count", "expert_used_count", "head_dim?",
    "file_type", "vocab_size", "rope_dimension_count", "interleave_moe_layer_step", "expert_feed_forward_length_moe",
    "sliding_window_off?",
)  # fmt: skip
LLAMA4_GGUF = GGUFSpec(
    "llama4",
    ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    _LLAMA4,
    "bpe",
    rope_freqs=True,
    skipped=("vision_model.", "multi_modal_projector."),
    halved_experts=True,
    assumed=llama_cpp_runs,
)


class Llama4(Family):
    name = "llama4"
    hf_model_types = ("llama4_text", "llama4")
    hf_architecture = "Llama4ForCausalLM"
    fields: ClassVar[type[Llama4Fields]] = Llama4Fields
    gguf = LLAMA4_GGUF

    def _layers(self, cfg: ModelConfig) -> list[list[Part]]:
        moe = cfg.fields(Llama4Fields)
        return [layer_parts(cfg, moe.is_moe_layer(i)) for i in range(cfg.num_layers)]

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.hidden_size)}
        for i, parts in enumerate(self._layers(cfg)):
            shapes.update({f"layers.{i}.{p.canonical}": p.shape for p in parts})
        shapes["norm.scale"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
        return shapes

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        mm = cfg.fields(Llama4Fields).multimodal
        m, head = ("language_model.model.", "language_model.") if mm else ("model.", "")
        rules = [Rule(m + "embed_tokens.weight", ("tok_embeddings.weight",))]
        for i, parts in enumerate(self._layers(cfg)):
            rules += [Rule(f"{m}layers.{i}.{p.hf}", (f"layers.{i}.{p.canonical}",)) for p in parts]
        rules.append(Rule(m + "norm.weight", ("norm.scale",)))
        if not cfg.tie_word_embeddings:
            rules.append(Rule(head + "lm_head.weight", ("output.weight",)))
        return Layout(tuple(rules), (), (), unused=VISION if mm else ())

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout:
        """The canonical names (torchtitan's Llama 4 adapter is not matched), the vision tower beside them."""
        names = self.canonical_shapes(cfg)
        return Layout(tuple(Rule(n, (n,)) for n in names), (), (), unused=VISION)

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """Its HF config.json (the vision config with it)."""
        return "config.json", self.config_to_hf(cfg, dtype)

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        return cfg

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        multimodal = "text_config" in cfg
        text = dict(cfg["text_config"]) if multimodal else cfg
        layers = int(text["num_hidden_layers"])
        step = int(text.get("interleave_moe_layer_step") or 1)
        moe_layers = text.get("moe_layers")
        if moe_layers is None:
            moe_layers = list(range(step - 1, layers, step))
        own = self.fields(
            num_experts=int(text.get("num_local_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 1),
            dense_layers=[i for i in range(layers) if i not in moe_layers],
            intermediate_size_mlp=int(text.get("intermediate_size_mlp") or text["intermediate_size"]),
            interleave_moe_layer_step=step,
            no_rope_layers=list(text.get("no_rope_layers") or []),
            no_rope_layer_interval=int(text.get("no_rope_layer_interval", 4)),
            layer_types=list(text.get("layer_types") or []),
            attention_chunk_size=text.get("attention_chunk_size"),
            use_qk_norm=bool(text.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
            floor_scale=int(text.get("floor_scale", 8192)),
            attn_scale=float(text.get("attn_scale", 0.1)),
            router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001)),
            router_jitter_noise=float(text.get("router_jitter_noise", 0.0)),
            multimodal=multimodal,
            vision_config=cfg.get("vision_config") if multimodal else None,
            wrapper={k: cfg[k] for k in _WRAPPER if k in cfg} if multimodal else {},
        )
        if multimodal and "tie_word_embeddings" in cfg:
            text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
        return hf_common_config(text, self.name, own)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        f = cfg.fields(Llama4Fields)
        text = hf_common_fields(cfg, self.hf_architecture, "llama4_text", dtype)
        text.update(
            attention_bias=cfg.attention_bias,
            attention_chunk_size=f.attention_chunk_size,
            attn_scale=f.attn_scale,
            attn_temperature_tuning=f.attn_temperature_tuning,
            floor_scale=f.floor_scale,
            initializer_range=0.02,
            interleave_moe_layer_step=f.interleave_moe_layer_step,
            intermediate_size_mlp=f.intermediate_size_mlp,
            layer_types=f.layer_types,
            moe_layers=[i for i in range(cfg.num_layers) if f.is_moe_layer(i)],
            no_rope_layer_interval=f.no_rope_layer_interval,
            no_rope_layers=f.no_rope_layers,
            num_experts_per_tok=f.num_experts_per_tok,
            num_local_experts=f.num_experts,
            output_router_logits=False,
            router_aux_loss_coef=f.router_aux_loss_coef,
            router_jitter_noise=f.router_jitter_noise,
            use_qk_norm=f.use_qk_norm,
        )
        text.pop("rope_theta", None)
        if not f.multimodal:
            return text
        tie = text["tie_word_embeddings"]
        text.pop("architectures")
        out: dict[str, Any] = {"architectures": ["Llama4ForConditionalGeneration"], **f.wrapper, "dtype": dtype}
        out.update(model_type="llama4", text_config=text, tie_word_embeddings=tie, vision_config=f.vision_config)
        return out


register(Llama4())
