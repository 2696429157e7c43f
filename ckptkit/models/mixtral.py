"""Mixtral: Mistral with experts in every layer. HF names them
``block_sparse_moe.experts.E.w1/w2/w3`` + router ``block_sparse_moe.gate`` (or stacked
``mlp.experts.gate_up_proj`` / ``down_proj`` + ``mlp.gate``); Mistral's own release
``layers.N.feed_forward.experts.E.w1/w2/w3`` + ``feed_forward.gate``, with a ``moe``
section in ``params.json``. Experts and router are whole on every Meta rank."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.models.config import ModelConfig
from ckptkit.models.family import MetaSource
from ckptkit.models.features import SlidingWindow
from ckptkit.models.gguf_spec import MOE_TEXT_MODEL_PARAMETERS, GGUFExperts, GGUFSpec
from ckptkit.models.llama import meta_layer_rules, meta_output_rule
from ckptkit.models.mistral import Mistral, MistralFields
from ckptkit.models.moe import MoEFields, expert_rules, experts_layout_of
from ckptkit.models.registry import register
from ckptkit.models.spec import Layout, Rule, hf_common_config, hf_common_fields, hf_llama_layout

# llama.cpp's LlamaModel, with TextModel's expert keys
MIXTRAL_GGUF = GGUFSpec(
    "llama",
    ("MixtralForCausalLM",),
    (*MOE_TEXT_MODEL_PARAMETERS, "vocab_size", "rope_dimension_count"),
    "llama",
    permute_qk=True,
    rope_freqs=True,
    experts=GGUFExperts(("w1", "w2", "w3")),
)


@dataclass
class MixtralFields(MistralFields, MoEFields):
    """Mistral's fields and experts in every layer."""


class Mixtral(Mistral):
    name = "mixtral"
    hf_model_types = ("mixtral",)
    hf_architecture = "MixtralForCausalLM"
    fields: ClassVar[type[MixtralFields]] = MixtralFields
    meta_container = "pth"
    gguf = MIXTRAL_GGUF

    def hf_layout(self, cfg: ModelConfig) -> Layout:
        base = hf_llama_layout(cfg)
        attn = tuple(r for r in base.layer if ".mlp." not in r.native)
        p = "model.layers.{i}."
        moe = expert_rules(
            cfg, 0, p + "block_sparse_moe.", ("w1", "w3", "w2"), p + "block_sparse_moe.gate.weight", p + "mlp."
        )
        if cfg.fields(MoEFields).experts_layout == "stacked":
            moe = (Rule(p + "mlp.gate.weight", moe[0].canonical), *moe[1:])
        moe = tuple(
            Rule(r.native, tuple(c.replace("layers.0.", "layers.{i}.") for c in r.canonical), r.kind) for r in moe
        )
        return Layout(base.head, attn[:4] + moe + attn[4:], base.tail, base.unused)

    def meta_layout(self, cfg: ModelConfig) -> Layout:
        f = "layers.{i}.feed_forward."
        layer = tuple(r for r in meta_layer_rules() if ".feed_forward." not in r.native)
        moe: list[Rule] = [Rule(f + "gate.weight", ("layers.{i}.mlp.router.weight",))]
        for e in range(cfg.fields(MoEFields).num_experts):
            for w in ("w1", "w2", "w3"):
                moe.append(Rule(f"{f}experts.{e}.{w}.weight", (f"layers.{{i}}.mlp.experts.{e}.{w}.weight",)))
        return Layout(
            head=(Rule("tok_embeddings.weight", ("tok_embeddings.weight",)),),
            layer=layer[:4] + tuple(moe) + layer[4:],
            tail=(Rule("norm.weight", ("norm.scale",)), meta_output_rule(cfg)),
        )

    def refine_config(self, cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
        return experts_layout_of(cfg, names)

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        own = self.fields(
            sliding_window=cfg.get("sliding_window"),
            num_experts=int(cfg.get("num_local_experts") or 8),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 2),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            norm_topk_prob=True,
        )
        return hf_common_config(cfg, self.name, own)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = hf_common_fields(cfg, self.hf_architecture, self.hf_model_types[0], dtype)
        moe = cfg.fields(MoEFields)
        out.update(
            sliding_window=cfg.fields(SlidingWindow).sliding_window,
            initializer_range=0.02,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok,
            router_aux_loss_coef=moe.router_aux_loss_coef,
            output_router_logits=False,
        )
        return out

    def config_from_meta(self, src: MetaSource) -> ModelConfig:
        moe = src.params.get("moe")
        if not isinstance(moe, dict) or "num_experts" not in moe:
            experts = {k.split(".")[4] for k in src.shapes if k.startswith("layers.0.feed_forward.experts.")}
            if experts:  # the tensors say Mixtral; how many experts route each token, only params.json can
                raise CkptkitError(
                    f"no 'moe' section, yet its tensors hold {len(experts)} experts per layer: add "
                    f'"moe": {{"num_experts": {len(experts)}, "num_experts_per_tok": K}} '
                    "(Mixtral routes each token to 2)"
                )
            raise CkptkitError("params.json has no 'moe' section with num_experts: not a Mixtral")
        return (
            super()
            .config_from_meta(src)
            .replace_fields(
                num_experts=int(moe["num_experts"]),
                num_experts_per_tok=int(moe.get("num_experts_per_tok", 2)),
                norm_topk_prob=True,
                router_aux_loss_coef=0.001,
            )
        )

    def config_to_meta(self, cfg: ModelConfig) -> dict[str, Any]:
        out = super().config_to_meta(cfg)
        moe = cfg.fields(MoEFields)
        out["moe"] = {"num_experts_per_tok": moe.num_experts_per_tok, "num_experts": moe.num_experts}
        return out


def detect_meta(src: MetaSource, where: str) -> str | None:
    """Mistral's Mixtral releases: a ``moe`` section in params.json, or experts among the tensors."""
    moe = isinstance(src.params.get("moe"), dict)
    return "mixtral" if moe or any(k.startswith("layers.0.feed_forward.experts.") for k in src.shapes) else None


register(Mixtral(), detect_meta=detect_meta)
