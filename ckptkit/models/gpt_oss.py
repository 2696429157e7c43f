"""gpt-oss: attention sinks (one learned logit per head), sliding and full attention layers
(``layer_types``), biases on every projection and on the router, and experts in every layer
stacked as transformers and OpenAI's release hold them: ``mlp.experts.gate_up_proj``
[E, hidden, 2 * intermediate] (gate and up columns interleaved, gate first) and
``mlp.experts.down_proj`` [E, intermediate, hidden], each with its bias.

The experts are canonical as they are stacked (``layers.{i}.mlp.experts.gate_up_proj``...):
every format but GGUF holds them so, and llama.cpp's ``gpt-oss`` (which transposes them and
splits the interleaved gate and up rows) is written by :mod:`ckptkit.formats.gguf`. DCP holds
the canonical names (torchtitan has no gpt-oss of its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.family import Family
from ckptkit.models.features import SlidingWindow
from ckptkit.models.fields import positive_float, positive_int
from ckptkit.models.gguf_spec import MOE_TEXT_MODEL_PARAMETERS, GGUFSpec
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_output_rule

SLIDING, FULL = "sliding_attention", "full_attention"
MX_BLOCK = 32  # MXFP4 values per scale (ckptkit.quant.mxfp4)


@dataclass
class GptOssFields(SlidingWindow):
    """The experts (every layer), the layers' attention kinds and the clamped SwiGLU's constants.

    Attributes:
        layer_types: ``sliding_attention`` or ``full_attention`` per layer.
        swiglu_limit: gate and up are clamped to this before the activation.
        swiglu_alpha: the gate's sigmoid slope.
        mxfp4_experts: the experts are stored as OpenAI's release stores them, MXFP4
            ``*_blocks`` (uint8 [E, rows, cols / 32, 16]; their ``*_scales`` beside them).
    """

    checks = {
        "num_local_experts": positive_int,
        "swiglu_limit": positive_float,
        "swiglu_alpha": positive_float,
    }

    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    router_aux_loss_coef: float = 0.9
    layer_types: list[str] | None = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    initializer_range: float = 0.02
    mxfp4_experts: bool = False


ATTN = (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "output_proj"))
EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def layer_shapes(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """One layer's tensors: HF name past ``model.layers.{i}.``, canonical past ``layers.{i}.``, shape."""
    f = cfg.fields(GptOssFields)
    h, e, inter = cfg.hidden_size, f.num_local_experts, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h}
    out: list[tuple[str, str, tuple[int, ...]]] = [("input_layernorm.weight", "sa_norm.scale", (h,))]
    for hf, canon in ATTN:
        shape = (h, q) if hf == "o_proj" else (rows[hf], h)
        out.append((f"self_attn.{hf}.weight", f"attn.{canon}.weight", shape))
        out.append((f"self_attn.{hf}.bias", f"attn.{canon}.bias", (rows[hf],)))
    out.append(("self_attn.sinks", "attn.sinks", (cfg.num_heads,)))
    out.append(("post_attention_layernorm.weight", "mlp_norm.scale", (h,)))
    out += [("mlp.router.weight", "mlp.router.weight", (e, h)), ("mlp.router.bias", "mlp.router.bias", (e,))]
    experts = {
        "gate_up_proj": (e, h, 2 * inter),
        "gate_up_proj_bias": (e, 2 * inter),
        "down_proj": (e, inter, h),
        "down_proj_bias": (e, h),
    }
    if f.mxfp4_experts:  # [E, rows, cols] transposed, in blocks of 32 columns packed two per byte
        experts = {
            "gate_up_proj_blocks": (e, 2 * inter, h // MX_BLOCK, MX_BLOCK // 2),
            "gate_up_proj_bias": (e, 2 * inter),
            "down_proj_blocks": (e, h, inter // MX_BLOCK, MX_BLOCK // 2),
            "down_proj_bias": (e, h),
        }
    out += [(f"mlp.experts.{k}", f"mlp.experts.{k}", shape) for k, shape in experts.items()]
    return out


# llama.cpp's GptOssModel: TextModel's keys, then the window and the experts' width
GPT_OSS_GGUF = GGUFSpec(
    "gpt-oss",
    ("GptOssForCausalLM",),
    (*MOE_TEXT_MODEL_PARAMETERS, "sliding_window", "expert_feed_forward_length_mla"),
    "bpe",
    sliding_pattern=2,
    interleaved_experts=True,
)


class GptOss(Family):
    name = "gpt_oss"
    hf_model_types = ("gpt_oss",)
    hf_architecture = "GptOssForCausalLM"
    fields: ClassVar[type[GptOssFields]] = GptOssFields
    gguf = GPT_OSS_GGUF

    def canonical_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.hidden_size)}
        for i in range(cfg.num_layers):
            shapes.update({f"layers.{i}.{canon}": shape for _, canon, shape in layer_shapes(cfg)})
        shapes["norm.scale"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
        return shapes

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        layer = tuple(Rule(f"model.layers.{{i}}.{hf}", (f"layers.{{i}}.{c}",)) for hf, c, _ in layer_shapes(cfg))
        return Layout(
            head=(Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)),),
            layer=layer,
            tail=(Rule("model.norm.weight", ("norm.scale",)), hf_output_rule(cfg)),
        )

    def dcp_layout(self, cfg: ModelConfig, titan: bool) -> Layout:
        """The canonical names (torchtitan has no gpt-oss model of its own)."""
        rules = [Rule(name, (name,)) for name in self.canonical_shapes(cfg)]
        return Layout(tuple(rules), ())

    def dcp_config(self, cfg: ModelConfig, dtype: str) -> tuple[str, dict[str, Any]]:
        """Its HF config.json: DCP keeps no config of its own in a checkpoint."""
        return "config.json", self.config_to_hf(cfg, dtype)

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        """MXFP4 experts where the names hold ``*_blocks`` (the release's layout)."""
        return cfg.replace_fields(mxfp4_experts=any(n.endswith("experts.gate_up_proj_blocks") for n in names))

    def sliding_windows(self, cfg: ModelConfig) -> list[int | None]:
        f = cfg.fields(GptOssFields)
        return [f.sliding_window if kind == SLIDING else None for kind in layer_types(cfg)]

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        own = self.fields(
            sliding_window=cfg.get("sliding_window"),
            num_local_experts=int(cfg.get("num_local_experts") or 32),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.9)),
            layer_types=list(cfg["layer_types"]) if cfg.get("layer_types") else None,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )
        model = hf_common_config(cfg, self.name, own, attention_bias=True)
        if own.layer_types is not None and (
            len(own.layer_types) != model.num_layers or set(own.layer_types) - {SLIDING, FULL}
        ):
            raise CkptkitError(
                f"config.json layer_types must give {model.num_layers} of {SLIDING!r} / {FULL!r}, "
                f"not {own.layer_types!r}"
            )
        return model

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        f = cfg.fields(GptOssFields)
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
        out.update(
            attention_bias=True,
            initializer_range=f.initializer_range,
            layer_types=layer_types(cfg),
            num_local_experts=f.num_local_experts,
            num_experts_per_tok=f.num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=f.router_aux_loss_coef,
            sliding_window=f.sliding_window,
            swiglu_alpha=f.swiglu_alpha,
            swiglu_limit=f.swiglu_limit,
        )
        return out


def layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's attention kind; transformers' default when config.json gives none
    (sliding in the even layers, full in the odd ones)."""
    f = cfg.fields(GptOssFields)
    return list(f.layer_types or [SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_layers)])


register(GptOss())
