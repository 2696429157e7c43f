"""The Llama family: Llama 2, Llama 3, Llama 3.1 (rope scaling), Llama 3.2 (tied).

Meta's layout stores q/k rows in interleaved-pair rope order (canonical is HF's
rotate-half order), names modules ``attention.wq`` ... ``feed_forward.w1``, and derives
the FFN size from ``dim``, ``multiple_of`` and ``ffn_dim_multiplier``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError, UnknownModel
from ckptkit.models.config import FamilyFields, ModelConfig
from ckptkit.models.family import Family, MetaSource
from ckptkit.models.fields import optional, positive_float, positive_int
from ckptkit.models.gguf_spec import TEXT_MODEL_PARAMETERS, GGUFSpec
from ckptkit.models.meta_ffn import meta_ffn_params, meta_ffn_size
from ckptkit.models.registry import register
from ckptkit.models.rope_freqs import rope_freqs_bytes
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_llama_layout, rope_parameters
from ckptkit.models.tokenizer_spec import SENTENCEPIECE, TIKTOKEN, TokenizerSpec
from ckptkit.tensors.lazy import Lazy, bytes_lazy
from ckptkit.tensors.transforms import COPY, ROPE_K, ROPE_Q, TIED

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass
class MetaFFN(FamilyFields):
    """Meta's params.json spelling of the FFN size (``multiple_of``, ``ffn_dim_multiplier``),
    kept for exact round trips; None when the source did not spell it so."""

    checks = {"multiple_of": optional(positive_int), "ffn_dim_multiplier": optional(positive_float)}

    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None


# llama.cpp's LlamaModel (Mistral's too): q/k rows back in Meta's order, Llama 3 rope scaling
# as the rope_freqs tensor.
LLAMA_GGUF = GGUFSpec(
    "llama",
    ("LlamaForCausalLM", "MistralForCausalLM"),
    (*TEXT_MODEL_PARAMETERS, "vocab_size", "rope_dimension_count"),
    "llama",
    permute_qk=True,
    rope_freqs=True,
)

# --- tokenizers -----------------------------------------------------------------------------
# Meta's Llama 3.x ship a tiktoken rank file whose special tokens live only in Meta's code:
# 256 of them, appended after the ranked tokens in a fixed order (Llama 3 and Llama 3.1+ name
# some differently). Llama 2 ships a sentencepiece model. The HF side (BOS/EOS, stop tokens,
# sampling defaults, chat template) follows the official HF repos and Meta's own generation code.
RESERVED_SPECIALS = 256


def _llama3_specials(named: list[str], first_reserved: int) -> tuple[str, ...]:
    reserved = [f"<|reserved_special_token_{first_reserved + i}|>" for i in range(RESERVED_SPECIALS - len(named))]
    return (*named, *reserved)


# Meta Llama 3 (April 2024).
LLAMA3_SPECIALS = _llama3_specials(
    [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ],
    5,
)
# Meta Llama 3.1 and later (llama_models' tokenizer).
LLAMA3_1_SPECIALS = _llama3_specials(
    [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
        "<|image|>",
    ],
    2,
)

# Meta's chat format for Llama 3.x (llama_models' ChatFormat): a header per message, the
# content as given, <|eot_id|> after it; the prompt ends with an open assistant header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

META_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}  # Meta's generation defaults


def _llama3(specials: tuple[str, ...], stop: tuple[str, ...]) -> TokenizerSpec:
    return TokenizerSpec(
        TIKTOKEN,
        specials,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        stop,
        META_SAMPLING,
        LLAMA3_CHAT_TEMPLATE,
    )


LLAMA2_TOKENIZER = TokenizerSpec(SENTENCEPIECE, generation={**META_SAMPLING, "pad_token": "<unk>"})
LLAMA3_TOKENIZER = _llama3(LLAMA3_SPECIALS, ("<|end_of_text|>", "<|eot_id|>"))
LLAMA3_1_TOKENIZER = _llama3(LLAMA3_1_SPECIALS, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))


def meta_layer_rules() -> tuple[Rule, ...]:
    a, f = "layers.{i}.attention.", "layers.{i}.feed_forward."
    return (
        Rule(a + "wq.weight", ("layers.{i}.attn.q_proj.weight",), ROPE_Q),
        Rule(a + "wk.weight", ("layers.{i}.attn.k_proj.weight",), ROPE_K),
        Rule(a + "wv.weight", ("layers.{i}.attn.v_proj.weight",)),
        Rule(a + "wo.weight", ("layers.{i}.attn.output_proj.weight",)),
        Rule(f + "w1.weight", ("layers.{i}.mlp.w1.weight",)),
        Rule(f + "w2.weight", ("layers.{i}.mlp.w2.weight",)),
        Rule(f + "w3.weight", ("layers.{i}.mlp.w3.weight",)),
        Rule("layers.{i}.attention_norm.weight", ("layers.{i}.sa_norm.scale",)),
        Rule("layers.{i}.ffn_norm.weight", ("layers.{i}.mlp_norm.scale",)),
    )


def meta_output_rule(cfg: ModelConfig) -> Rule:
    # Meta's tied checkpoints (Llama 3.2) still store output.weight, equal to the embeddings.
    if cfg.tie_word_embeddings:
        return Rule("output.weight", ("tok_embeddings.weight",), TIED)
    return Rule("output.weight", ("output.weight",), COPY)


class Llama2(Family):
    name = "llama2"
    tokenizer = LLAMA2_TOKENIZER
    gguf = LLAMA_GGUF
    hf_model_types = ("llama",)
    hf_architecture = "LlamaForCausalLM"
    fields: ClassVar[type[MetaFFN]] = MetaFFN
    meta_container = "pth"
    vocab_parallel = False
    default_theta: ClassVar[float] = 10000.0
    max_positions: ClassVar[int] = 4096
    rope_factor: ClassVar[float | None] = None

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        return hf_llama_layout(cfg)

    def meta_layout(self, cfg: ModelConfig) -> Layout:
        # Llama 2's own order: embeddings, final norm, output, layers, rope.freqs.
        return Layout(
            head=(
                Rule("tok_embeddings.weight", ("tok_embeddings.weight",)),
                Rule("norm.weight", ("norm.scale",)),
                meta_output_rule(cfg),
            ),
            layer=meta_layer_rules(),
            unused=(r"rope\.freqs",),
        )

    def meta_extra_tensors(self, cfg: ModelConfig) -> dict[str, Lazy]:
        hd, theta = cfg.head_dim, cfg.rope_theta
        raw = functools.cache(lambda: rope_freqs_bytes(hd, theta))
        return {"rope.freqs": bytes_lazy((hd // 2,), "bfloat16", raw)}

    def rope_scaling(self) -> dict[str, Any] | None:
        if self.rope_factor is None:
            return None
        return {**LLAMA3_SCALING, "factor": self.rope_factor}

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return hf_common_config(cfg, self.name, self.fields())

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1, initializer_range=0.02)
        return out

    def config_from_meta(self, src: MetaSource) -> ModelConfig:
        params, shapes, tied = src.params, src.shapes, meta_tied(src)
        try:
            dim, n_heads, n_layers = int(params["dim"]), int(params["n_heads"]), int(params["n_layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise CkptkitError(f"missing or invalid field {e}") from None
        n_kv = int(params.get("n_kv_heads") or n_heads)
        head_dim = int(params.get("head_dim") or dim // n_heads)
        emb = shapes.get("tok_embeddings.weight")
        if emb is None:
            raise CkptkitError("tok_embeddings.weight is missing")
        vocab = int(params.get("vocab_size") or -1)
        if vocab > 0 and vocab != emb[0]:
            raise CkptkitError(f"vocab_size {vocab} contradicts tok_embeddings.weight, which has {emb[0]} rows")
        w1 = shapes.get("layers.0.feed_forward.w1.weight")
        multiple_of, mult = None, None
        if "hidden_dim" in params:
            ffn = int(params["hidden_dim"])
            what = f"hidden_dim {ffn}"
        else:
            mult = params.get("ffn_dim_multiplier")
            multiple_of = int(params.get("multiple_of", 256))
            ffn = meta_ffn_size(dim, multiple_of, mult)
            what = f"dim {dim}, multiple_of {multiple_of}, ffn_dim_multiplier {mult} give FFN size {ffn}"
        if w1 is not None and w1[0] != ffn:
            raise CkptkitError(f"contradicts the tensors: {what}, but layers.0.feed_forward.w1.weight has {w1[0]} rows")
        scaled = params.get("use_scaled_rope", False)
        if not isinstance(scaled, bool):  # the one Llama-only field; the rest: models/fields.py
            raise CkptkitError(f"field 'use_scaled_rope' must be true or false, not {scaled!r}")
        return ModelConfig(
            model_type=self.name,
            vocab_size=emb[0],
            hidden_size=dim,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=ffn,
            norm_eps=float(params.get("norm_eps", 1e-5)),
            rope_theta=float(params.get("rope_theta", self.default_theta)),
            rope_scaling=self.rope_scaling() if scaled else None,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=tied,
            extra=self.fields(multiple_of=multiple_of, ffn_dim_multiplier=mult),
        )

    def _meta_ffn(self, cfg: ModelConfig) -> tuple[int, float | None]:
        ffn = cfg.fields(MetaFFN)
        mo, mult = ffn.multiple_of, ffn.ffn_dim_multiplier
        if mo is not None and meta_ffn_size(cfg.hidden_size, mo, mult) == cfg.intermediate_size:
            return mo, mult
        return meta_ffn_params(cfg.hidden_size, cfg.intermediate_size)

    def config_to_meta(self, cfg: ModelConfig) -> dict[str, Any]:
        multiple_of, mult = self._meta_ffn(cfg)
        out: dict[str, Any] = {"dim": cfg.hidden_size, "multiple_of": multiple_of}
        if mult is not None:
            out["ffn_dim_multiplier"] = mult
        out.update(n_heads=cfg.num_heads, n_layers=cfg.num_layers)
        if cfg.num_kv_heads != cfg.num_heads:
            out["n_kv_heads"] = cfg.num_kv_heads
        out.update(norm_eps=cfg.norm_eps, vocab_size=-1)
        if cfg.rope_theta != self.default_theta:
            out["rope_theta"] = cfg.rope_theta
        return out


class Llama3(Llama2):
    name = "llama3"
    vocab_parallel = True
    tokenizer = LLAMA3_TOKENIZER
    default_theta = 500000.0
    max_positions = 8192

    def meta_layout(self, cfg: ModelConfig) -> Layout:
        # Llama 3's own order: embeddings, layers, final norm, output.
        return Layout(
            head=(Rule("tok_embeddings.weight", ("tok_embeddings.weight",)),),
            layer=meta_layer_rules(),
            tail=(Rule("norm.weight", ("norm.scale",)), meta_output_rule(cfg)),
            unused=(r"rope\.freqs",),
        )

    def meta_extra_tensors(self, cfg: ModelConfig) -> dict[str, Lazy]:
        return {}

    def config_to_meta(self, cfg: ModelConfig) -> dict[str, Any]:
        multiple_of, mult = self._meta_ffn(cfg)
        out: dict[str, Any] = {
            "dim": cfg.hidden_size,
            "n_layers": cfg.num_layers,
            "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads,
            "vocab_size": cfg.vocab_size,
            "multiple_of": multiple_of,
        }
        if mult is not None:
            out["ffn_dim_multiplier"] = mult
        out.update(norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
        if cfg.rope_scaling:
            out["use_scaled_rope"] = True
        return out


class Llama3_1(Llama3):
    name = "llama3_1"
    tokenizer = LLAMA3_1_TOKENIZER
    max_positions = 131072
    rope_factor = 8.0


class Llama3_2(Llama3_1):
    name = "llama3_2"
    rope_factor = 32.0


def meta_tied(src: MetaSource) -> bool:
    """Whether Meta's output.weight repeats tok_embeddings (Llama 3.2 vs 3.1).

    Judged from a fixed-size sample, so opening stays independent of the weights' size;
    a conversion still checks the whole tensors before it drops the copy.
    """
    emb, out = src.shapes.get("tok_embeddings.weight"), src.shapes.get("output.weight")
    if emb is None:
        return False
    if out is None:
        return True
    if not src.params.get("use_scaled_rope") or emb != out:
        return False
    return src.output_repeats_embeddings()


def _which_llama(theta: float) -> str | None:
    return {10000.0: "llama2", 500000.0: "llama3"}.get(theta)


def detect_hf(cfg: dict[str, Any], where: str) -> str | None:
    """Which Llama an HF config.json describes (None: not a Llama); an error when unsure."""
    if cfg.get("model_type") != "llama":
        return None
    theta, scaling = rope_parameters(cfg)
    name = _which_llama(theta)
    if scaling:
        name = None
        if scaling.get("rope_type") == "llama3":
            tied = scaling.get("factor") == 32.0 or cfg.get("tie_word_embeddings")
            name = "llama3_2" if tied else "llama3_1"
    if name is None:
        raise UnknownModel(
            f"{where}: cannot tell which Llama this is from its rope settings; pass --model-type "
            "(llama2, llama3, llama3_1 or llama3_2)"
        )
    return name


def detect_meta(src: MetaSource, where: str) -> str:
    """Which Llama Meta's params.json describes (the catch-all Meta family); an error when unsure."""
    params = src.params
    if params.get("use_scaled_rope"):
        return "llama3_2" if meta_tied(src) else "llama3_1"
    name = _which_llama(float(params.get("rope_theta", 10000.0)))
    if name is None:
        raise UnknownModel(
            f"{where}: cannot tell which Llama this is (rope_theta {params.get('rope_theta')}); pass --model-type"
        )
    return name


register(Llama2(), Llama3(), Llama3_1(), Llama3_2(), detect_hf=detect_hf, detect_meta=detect_meta)
