"""The family-independent model config every format is translated to and from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer, in ckptkit's canonical terms.

    Canonical tensor names (HF rotate-half rope layout for q/k, every family):

        tok_embeddings.weight
        layers.{i}.sa_norm.scale
        layers.{i}.attn.{q,k,v}_proj.weight     (+ .bias when ``attention_bias``)
        layers.{i}.attn.output_proj.weight
        layers.{i}.mlp_norm.scale
        layers.{i}.mlp.w1.weight  (gate)   layers.{i}.mlp.w3.weight  (up)
        layers.{i}.mlp.w2.weight  (down)
        norm.scale
        output.weight                            (absent when ``tie_word_embeddings``)
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style llama3 scaling dict: rope_type, factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings. None: plain rope.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight)
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Attention window: Mistral and Phi-3 slide in every layer when ``sliding_window`` is
    # set; Qwen2 only with ``use_sliding_window``, from layer ``max_window_layers`` on
    # (the family decides: :meth:`~ckptkit.models.family.Family.sliding_windows`).
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    partial_rotary_factor: float = 1.0  # Phi-3: rope on this fraction of head_dim
    # Carried for exact config round trips; None when the source config lacks them.
    original_max_position_embeddings: int | None = None  # Phi-3 config.json
    resid_pdrop: float | None = None  # Phi-3 config.json
    embd_pdrop: float | None = None  # Phi-3 config.json
    multiple_of: int | None = None  # Meta params.json FFN spelling (Llama)
    ffn_dim_multiplier: float | None = None  # Meta params.json FFN spelling (Llama)
    # Norm placement: ``input_norms`` before attention and MLP (sa_norm, mlp_norm);
    # ``post_norms`` on their outputs (attn_post_norm, mlp_post_norm; Gemma 2/3, OLMo 2).
    input_norms: bool = True
    post_norms: bool = False
    # RMSNorm of queries and keys: "head" (per head, head_dim wide; Qwen3, Gemma 3) or
    # "proj" (over the whole projection; OLMo 2); None: none.
    qk_norm: str | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma 2/3)
    attn_logit_softcapping: float | None = None  # cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the output logits (Gemma 2)
    # Per-layer attention kind ("sliding_attention" / "full_attention"), when the config lists them.
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None  # rope base of sliding-window layers (Gemma 3)
    # Mixture of experts (0 experts: dense).  Layers in ``dense_layers`` keep a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    router_aux_loss_coef: float = 0.0
    dense_layers: list[int] | None = None
    # How experts lie on disk: one tensor per expert ("per-expert") or stacked 3-D ("stacked").
    experts_layout: str = "per-expert"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in (self.dense_layers or [])

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of :meth:`to_dict`; also reads the ``extra`` dict of older ckptkit.json files."""
        names = {f.name for f in dataclasses.fields(cls)}
        merged = {**(data.get("extra") or {}), **data}
        return cls(**{k: v for k, v in merged.items() if k in names})


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of ``cfg`` with its shape, in canonical (module) order."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}attn.{name}_proj.weight"] = (rows, h)
            if cfg.attention_bias:
                shapes[f"{p}attn.{name}_proj.bias"] = (rows,)
        shapes[f"{p}attn.output_proj.weight"] = (h, q)
        if cfg.qk_norm:
            shapes[f"{p}attn.q_norm.scale"] = (hd,) if cfg.qk_norm == "head" else (q,)
            shapes[f"{p}attn.k_norm.scale"] = (hd,) if cfg.qk_norm == "head" else (kv,)
        if cfg.is_moe_layer(i):
            e_inter = cfg.expert_size
            shapes[f"{p}mlp.router.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                shapes[f"{p}mlp.experts.{e}.w1.weight"] = (e_inter, h)
                shapes[f"{p}mlp.experts.{e}.w3.weight"] = (e_inter, h)
                shapes[f"{p}mlp.experts.{e}.w2.weight"] = (h, e_inter)
        else:
            shapes[f"{p}mlp.w1.weight"] = (inter, h)
            shapes[f"{p}mlp.w3.weight"] = (inter, h)
            shapes[f"{p}mlp.w2.weight"] = (h, inter)
        if cfg.input_norms:
            shapes[f"{p}sa_norm.scale"] = (h,)
            shapes[f"{p}mlp_norm.scale"] = (h,)
        if cfg.post_norms:
            shapes[f"{p}attn_post_norm.scale"] = (h,)
            shapes[f"{p}mlp_post_norm.scale"] = (h,)
    shapes["norm.scale"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, h)
    return shapes
