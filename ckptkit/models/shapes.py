"""The canonical tensors of a model config, with their shapes."""

from __future__ import annotations

from ckptkit.models.config import ModelConfig
from ckptkit.models.moe import expert_size, experts, is_moe_layer


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of ``cfg`` with its shape, in canonical (module) order: the
    family's own (:meth:`~ckptkit.models.family.Family.canonical_shapes`) where it has other
    tensors than the decoder's below (DeepSeek V3's latent attention)."""
    from ckptkit.models.registry import REGISTRY

    family = REGISTRY.get(cfg.model_type)
    own = family.canonical_shapes(cfg) if family is not None else None
    return own if own is not None else decoder_shapes(cfg)


def decoder_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The canonical tensors of the decoder the families share (q/k/v attention)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    decoder, moe = cfg.decoder, experts(cfg)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}attn.{name}_proj.weight"] = (rows, h)
            if cfg.attention_bias:
                shapes[f"{p}attn.{name}_proj.bias"] = (rows,)
        shapes[f"{p}attn.output_proj.weight"] = (h, q)
        if decoder.qk_norm:
            shapes[f"{p}attn.q_norm.scale"] = (hd,) if decoder.qk_norm == "head" else (q,)
            shapes[f"{p}attn.k_norm.scale"] = (hd,) if decoder.qk_norm == "head" else (kv,)
        if moe is not None and is_moe_layer(cfg, i):
            e_inter = expert_size(cfg)
            shapes[f"{p}mlp.router.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes[f"{p}mlp.experts.{e}.w1.weight"] = (e_inter, h)
                shapes[f"{p}mlp.experts.{e}.w3.weight"] = (e_inter, h)
                shapes[f"{p}mlp.experts.{e}.w2.weight"] = (h, e_inter)
        else:
            shapes[f"{p}mlp.w1.weight"] = (inter, h)
            shapes[f"{p}mlp.w3.weight"] = (inter, h)
            shapes[f"{p}mlp.w2.weight"] = (h, inter)
        if decoder.input_norms:
            shapes[f"{p}sa_norm.scale"] = (h,)
            shapes[f"{p}mlp_norm.scale"] = (h,)
        if decoder.post_norms:
            shapes[f"{p}attn_post_norm.scale"] = (h,)
            shapes[f"{p}mlp_post_norm.scale"] = (h,)
    shapes["norm.scale"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, h)
    return shapes
