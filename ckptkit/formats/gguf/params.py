"""The ``<arch>.*`` keys: written from config.json as llama.cpp's model classes write them,
read back into config.json fields.

A family's :class:`~ckptkit.models.gguf_spec.GGUFSpec` lists its keys in llama.cpp's order
by the names of :data:`WRITERS`; a name ending in ``?`` is written only when config.json
has the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf import per_layer

Writer = Callable[[Any, dict[str, Any], Any], None]  # (gguf.GGUFWriter, config.json, file type)


def rope(hparams: dict[str, Any]) -> dict[str, Any]:
    """Rope settings of a config.json in either spelling, ``rope_theta`` and ``rope_type`` in;
    of the global layers where they are given per layer type."""
    out = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    out = dict(out.get("full_attention", out))
    if "rope_theta" not in out and hparams.get("rope_theta") is not None:
        out["rope_theta"] = hparams["rope_theta"]
    if "rope_type" not in out and out.get("type") is not None:
        out["rope_type"] = out["type"]
    return out


def _rope_scaling(w: Any, h: dict[str, Any], ftype: Any) -> None:
    import gguf

    settings = rope(h)
    kind, factor = settings.get("rope_type"), settings.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(settings["original_max_position_embeddings"])
        for key, add in (
            ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
            ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            value = settings.get(key, settings.get("attn_factor") if key == "attention_factor" else None)
            if value is not None:
                add(value)
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)


def _theta(h: dict[str, Any]) -> Any:
    return rope(h).get("rope_theta")


# llama.cpp's names for the sliding layers' rope base when not given per layer type
_LOCAL_THETA = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")


def _local_theta(h: dict[str, Any]) -> Any:
    """The rope base of the sliding-window layers (``rope_parameters.sliding_attention``)."""
    settings = h.get("rope_parameters", h.get("rope_scaling")) or {}
    if "full_attention" in settings or "sliding_attention" in settings:
        return (settings.get("sliding_attention") or {}).get("rope_theta")
    return next((h[k] for k in _LOCAL_THETA if h.get(k) is not None), None)


def _head_dim(w: Any, h: dict[str, Any]) -> None:
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])


def _partial_dims(h: dict[str, Any]) -> int:
    return int(rope(h).get("partial_rotary_factor", 1.0) * h["hidden_size"]) // h["num_attention_heads"]


def _original_context(h: dict[str, Any]) -> Any:
    return rope(h).get("original_max_position_embeddings", h.get("original_max_position_embeddings"))


WRITERS: dict[str, tuple[Writer, str | None]] = {
    # name: (write, the config.json field whose absence skips a "name?" key)
    "block_count": (lambda w, h, t: w.add_block_count(h["num_hidden_layers"]), None),
    "context_length": (lambda w, h, t: w.add_context_length(h["max_position_embeddings"]), "max_position_embeddings"),
    "embedding_length": (lambda w, h, t: w.add_embedding_length(h["hidden_size"]), None),
    "feed_forward_length": (lambda w, h, t: w.add_feed_forward_length(h["intermediate_size"]), None),
    "head_count": (lambda w, h, t: w.add_head_count(h["num_attention_heads"]), None),
    "head_count_kv": (
        lambda w, h, t: w.add_head_count_kv(h.get("num_key_value_heads", h["num_attention_heads"])),
        "num_key_value_heads",
    ),
    "rope_scaling": (_rope_scaling, None),
    "rope_freq_base": (lambda w, h, t: w.add_rope_freq_base(_theta(h)), "rope_theta"),
    "layer_norm_rms_eps": (lambda w, h, t: w.add_layer_norm_rms_eps(h["rms_norm_eps"]), "rms_norm_eps"),
    "head_dim": (lambda w, h, t: _head_dim(w, h), "head_dim"),
    "file_type": (lambda w, h, t: w.add_file_type(t), None),
    "vocab_size": (lambda w, h, t: w.add_vocab_size(h["vocab_size"]), None),
    "rope_dimension_count": (
        lambda w, h, t: w.add_rope_dimension_count(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]),
        None,
    ),
    "rope_partial_dimensions": (lambda w, h, t: w.add_rope_dimension_count(_partial_dims(h)), None),
    "rope_original_context": (lambda w, h, t: w.add_rope_scaling_orig_ctx_len(_original_context(h)), None),
    "sliding_window": (lambda w, h, t: w.add_sliding_window(h.get("sliding_window") or 0), None),
    "attn_logit_softcapping": (
        lambda w, h, t: w.add_attn_logit_softcapping(h["attn_logit_softcapping"]),
        "attn_logit_softcapping",
    ),
    "final_logit_softcapping": (
        lambda w, h, t: w.add_final_logit_softcapping(h["final_logit_softcapping"]),
        "final_logit_softcapping",
    ),
    "rope_freq_base_swa": (lambda w, h, t: w.add_rope_freq_base_swa(_local_theta(h)), "rope_theta_swa"),
}
_PRESENT: dict[str, Callable[[dict[str, Any]], Any]] = {"rope_theta": _theta, "rope_theta_swa": _local_theta}


def _present(hparams: dict[str, Any], field: str) -> Any:
    """The value whose absence (None) skips a ``name?`` key."""
    get = _PRESENT.get(field)
    return get(hparams) if get is not None else hparams.get(field)


# --- mixture of experts (TextModel's expert keys, Qwen2MoeModel's expert feed-forward length) ---


def _first(h: dict[str, Any], fields: tuple[str, ...]) -> Any:
    """llama.cpp's ``find_hparam``: the first of ``fields`` config.json has."""
    return next(h[f] for f in fields if h.get(f) is not None)


WRITERS |= {
    "expert_count": (
        lambda w, h, t: w.add_expert_count(_first(h, ("num_local_experts", "num_experts", "n_routed_experts"))),
        None,
    ),
    "expert_used_count": (
        lambda w, h, t: w.add_expert_used_count(
            _first(h, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))
        ),
        None,
    ),
    "expert_feed_forward_length": (
        lambda w, h, t: w.add_expert_feed_forward_length(h["moe_intermediate_size"]),
        "moe_intermediate_size",
    ),
}


# --- DeepseekV2Model (deepseek2): latent attention written as one KV head of kv_lora_rank + rope dims ---


def _mla_lengths(w: Any, h: dict[str, Any]) -> None:
    w.add_key_length(h["kv_lora_rank"] + h["qk_rope_head_dim"])
    w.add_value_length(h["kv_lora_rank"])


def _mla(w: Any, h: dict[str, Any]) -> None:
    # key and value lengths: in TextModel's place (transformers' config always has a head_dim
    # for llama.cpp to write there, which DeepseekV2Model overwrites)
    w.add_key_length_mla(h["qk_nope_head_dim"] + h["qk_rope_head_dim"])
    w.add_value_length_mla(h["v_head_dim"])


_SCORE_FIELDS = (
    "score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
    "expert_selection_fn",
)  # fmt: skip


def _gating(w: Any, h: dict[str, Any]) -> None:
    """TextModel's expert gating function, from the router's score function."""
    import gguf

    func = _first(h, _SCORE_FIELDS)
    kinds = {"sigmoid": "SIGMOID", "softmax": "SOFTMAX", "sqrtsoftplus": "SQRTSOFTPLUS"}
    if func not in kinds:
        raise CkptkitError(f"config.json: expert score function {func!r} is none llama.cpp knows ({', '.join(kinds)})")
    w.add_expert_gating_func(getattr(gguf.ExpertGatingFuncType, kinds[func]))


def _leading_dense(h: dict[str, Any]) -> int:
    dense = h.get("first_k_dense_replace")
    if dense is None:
        return int(h["num_hidden_layers"]) if h.get("n_routed_experts") is None else 0
    return int(dense)


WRITERS |= {
    "head_count_kv_mla": (lambda w, h, t: w.add_head_count_kv(1), None),
    "expert_group_count": (lambda w, h, t: w.add_expert_group_count(h["n_group"]), "n_group"),
    "expert_group_used_count": (lambda w, h, t: w.add_expert_group_used_count(h["topk_group"]), "topk_group"),
    "head_dim_mla": (lambda w, h, t: _mla_lengths(w, h), None),
    "expert_gating_func": (lambda w, h, t: _gating(w, h), "scoring_func"),
    "leading_dense_block_count": (lambda w, h, t: w.add_leading_dense_block_count(_leading_dense(h)), None),
    "q_lora_rank": (lambda w, h, t: w.add_q_lora_rank(h["q_lora_rank"]), "q_lora_rank"),
    "kv_lora_rank": (lambda w, h, t: w.add_kv_lora_rank(h.get("kv_lora_rank", 512)), None),
    "mla_lengths": (lambda w, h, t: _mla(w, h), None),
    "expert_feed_forward_length_mla": (
        lambda w, h, t: w.add_expert_feed_forward_length(_first(h, ("moe_intermediate_size", "intermediate_size"))),
        None,
    ),
    "expert_shared_count": (lambda w, h, t: w.add_expert_shared_count(h.get("n_shared_experts", 0)), None),
    "expert_weights_scale": (
        lambda w, h, t: w.add_expert_weights_scale(h["routed_scaling_factor"]),
        "routed_scaling_factor",
    ),
    "expert_weights_norm": (lambda w, h, t: w.add_expert_weights_norm(True), "norm_topk_prob_set"),
    "rope_dimension_count_mla": (lambda w, h, t: w.add_rope_dimension_count(h["qk_rope_head_dim"]), None),
    "yarn_log_multiplier": (
        lambda w, h, t: w.add_rope_scaling_yarn_log_mul(0.1 * rope(h)["mscale_all_dim"]),
        "mscale_all_dim",
    ),
}
_PRESENT |= {
    "scoring_func": lambda h: next((h[f] for f in _SCORE_FIELDS if h.get(f) is not None), None),
    "norm_topk_prob_set": lambda h: True if h.get("norm_topk_prob") else None,
    "mscale_all_dim": lambda h: rope(h).get("mscale_all_dim"),
}


# --- Glm4MoeModel (glm4moe): the NextN layers counted as blocks, its own expert keys ---


def _glm_rope_dims(h: dict[str, Any]) -> int:
    head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    return int(head_dim * rope(h).get("partial_rotary_factor", 0.5))


def _nextn_blocks(h: dict[str, Any]) -> int:
    return int(h["num_hidden_layers"]) + int(h.get("num_nextn_predict_layers") or 0)


def _sigmoid(w: Any) -> None:
    import gguf

    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


WRITERS |= {
    "block_count_nextn": (lambda w, h, t: w.add_block_count(_nextn_blocks(h)), None),
    "rope_partial_head_dim": (lambda w, h, t: w.add_rope_dimension_count(_glm_rope_dims(h)), None),
    "shared_expert_count": (lambda w, h, t: w.add_expert_shared_count(h["n_shared_experts"]), "n_shared_experts"),
    "leading_dense_blocks": (
        lambda w, h, t: w.add_leading_dense_block_count(h["first_k_dense_replace"]),
        "first_k_dense_replace",
    ),
    "expert_gating_sigmoid": (lambda w, h, t: _sigmoid(w), None),
    "expert_weights_norm_value": (lambda w, h, t: w.add_expert_weights_norm(h["norm_topk_prob"]), "norm_topk_prob"),
    "nextn_predict_layers": (
        lambda w, h, t: w.add_nextn_predict_layers(h["num_nextn_predict_layers"]),
        "num_nextn_predict_layers",
    ),
}


# --- Llama4Model (llama4): the dense layers' width as TextModel's, the experts' its own -----------

WRITERS |= {
    "feed_forward_length_mlp": (lambda w, h, t: w.add_feed_forward_length(h["intermediate_size_mlp"]), None),
    "interleave_moe_layer_step": (
        lambda w, h, t: w.add_interleave_moe_layer_step(h["interleave_moe_layer_step"]),
        None,
    ),
    "expert_feed_forward_length_moe": (lambda w, h, t: w.add_expert_feed_forward_length(h["intermediate_size"]), None),
    "sliding_window_off": (lambda w, h, t: w.add_sliding_window(0), "all_full_attention"),
}
_PRESENT["all_full_attention"] = lambda h: (
    True if h.get("layer_types") is not None and all(t == "full_attention" for t in h["layer_types"]) else None
)


# --- the hybrid Qwen stacks (Qwen3NextModel and its Qwen3.5 subclasses) ----------------------------


def _blocks(h: dict[str, Any]) -> int:
    return int(h["num_hidden_layers"]) + int(h.get("mtp_num_hidden_layers") or 0)


def _sections(w: Any, h: dict[str, Any], default: bool) -> None:
    """The mRoPE sections padded to four; ``default``: Qwen3.5's when the config has none."""
    given = (h.get("rope_parameters", h.get("rope_scaling")) or {}).get("mrope_section")
    if default and given is None:
        w.add_rope_dimension_sections([11, 11, 10, 0])
    elif not default and given is not None:
        w.add_rope_dimension_sections((list(given) + [0, 0, 0, 0])[:4])


def _ssm(w: Any, h: dict[str, Any]) -> None:
    w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
    w.add_ssm_state_size(h["linear_key_head_dim"])
    w.add_ssm_group_count(h["linear_num_key_heads"])
    w.add_ssm_time_step_rank(h["linear_num_value_heads"])
    w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])


def _recurrent(w: Any, h: dict[str, Any]) -> None:
    types = h["layer_types"]
    if len(types) != h["num_hidden_layers"]:
        raise CkptkitError(f"config.json: layer_types has {len(types)} entries, not num_hidden_layers")
    flags = [t == "linear_attention" for t in types] + [False] * (_blocks(h) - len(types))
    w.add_array(f"{w.arch}.attention.recurrent_layers", flags)  # the gguf package has no add_ for it yet


def _hybrid_rope_dims(h: dict[str, Any]) -> int:
    head = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    return int(head * rope(h).get("partial_rotary_factor", 0.25))


WRITERS |= {
    "block_count_mtp": (lambda w, h, t: w.add_block_count(_blocks(h)), None),
    "feed_forward_length_given": (
        lambda w, h, t: w.add_feed_forward_length(h["intermediate_size"]),
        "intermediate_size",
    ),
    "rope_sections": (lambda w, h, t: _sections(w, h, False), None),
    "rope_sections_default": (lambda w, h, t: _sections(w, h, True), None),
    "expert_shared_feed_forward_length": (
        lambda w, h, t: w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"]),
        "shared_expert_intermediate_size",
    ),
    "mtp_predict_layers": (lambda w, h, t: w.add_nextn_predict_layers(h["mtp_num_hidden_layers"]), "mtp_layers"),
    "ssm": (lambda w, h, t: _ssm(w, h), None),
    "recurrent_layers": (lambda w, h, t: _recurrent(w, h), "layer_types"),
    "full_attention_interval": (
        lambda w, h, t: w.add_full_attention_interval(h.get("full_attention_interval", 4)),
        None,
    ),
    "rope_dimension_count_hybrid": (lambda w, h, t: w.add_rope_dimension_count(_hybrid_rope_dims(h)), None),
}
_PRESENT["mtp_layers"] = lambda h: h.get("mtp_num_hidden_layers") or None
WRITERS |= per_layer.WRITERS  # Gemma4Model's (layers of two kinds)
_PRESENT |= per_layer.PRESENT


def add_parameters(w: Any, names: tuple[str, ...], hparams: dict[str, Any], ftype: Any) -> None:
    """The keys ``names`` (a spec's ``parameters``) from config.json ``hparams``."""
    for name in names:
        write, field = WRITERS[name.rstrip("?")]
        if name.endswith("?") and field is not None and _present(hparams, field) is None:
            continue
        write(w, hparams, ftype)


# --- reading ------------------------------------------------------------------------------------

_FIELDS = {  # <arch>.KEY -> config.json field
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}


_FIELDS |= {  # mixture of experts
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def _int(kv: dict[str, Any], key: str) -> int | None:
    value = kv.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CkptkitError(f"metadata {key} must be a positive integer, not {value!r}")
    return value


def hparams_from_metadata(kv: dict[str, Any], arch: str) -> dict[str, Any]:
    """The config.json fields the ``<arch>.*`` keys give (the inverse of :data:`WRITERS`)."""
    out: dict[str, Any] = {}
    for key, field in _FIELDS.items():
        value = kv.get(f"{arch}.{key}")
        if value is None:
            continue
        if field == "rms_norm_eps":
            if not isinstance(value, float) or not 0 < value < 1:
                raise CkptkitError(f"metadata {arch}.{key} must be a float in (0, 1), not {value!r}")
            out[field] = value
        else:
            out[field] = _int(kv, f"{arch}.{key}")
    if "num_hidden_layers" not in out or "hidden_size" not in out or "num_attention_heads" not in out:
        raise CkptkitError(f"metadata lacks {arch}.block_count, {arch}.embedding_length or {arch}.attention.head_count")
    rope_settings: dict[str, Any] = {"rope_type": "default"}
    theta = kv.get(f"{arch}.rope.freq_base")
    if theta is not None:
        if not isinstance(theta, float) or not theta > 0:
            raise CkptkitError(f"metadata {arch}.rope.freq_base must be a positive float, not {theta!r}")
        rope_settings["rope_theta"] = theta
    kind = kv.get(f"{arch}.rope.scaling.type")
    factor = kv.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and isinstance(factor, float):
        rope_settings.update(rope_type=kind, factor=factor)
        if kind == "yarn":
            rope_settings["original_max_position_embeddings"] = _int(kv, f"{arch}.rope.scaling.original_context_length")
    elif kind not in (None, "none"):
        raise CkptkitError(f"metadata {arch}.rope.scaling.type {kind!r} is not supported for reading")
    dims = _int(kv, f"{arch}.rope.dimension_count")
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    if dims is not None and dims != head_dim:
        rope_settings["partial_rotary_factor"] = dims * out["num_attention_heads"] / out["hidden_size"]
    original = kv.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None and kind != "yarn":
        out["original_max_position_embeddings"] = _int(kv, f"{arch}.rope.scaling.original_context_length")
    window = kv.get(f"{arch}.attention.sliding_window")
    if window is not None:
        out["sliding_window"] = _int(kv, f"{arch}.attention.sliding_window") if window else None
    out["rope_parameters"] = rope_settings
    if "rope_theta" in rope_settings:
        out["rope_theta"] = rope_settings["rope_theta"]
    local = kv.get(f"{arch}.rope.freq_base_swa")
    if local is not None:  # a rope base of its own for the sliding layers: rope_parameters per layer type
        if not isinstance(local, float) or not local > 0:
            raise CkptkitError(f"metadata {arch}.rope.freq_base_swa must be a positive float, not {local!r}")
        local_settings = {"rope_type": "default", "rope_theta": local}
        out["rope_parameters"] = {"full_attention": rope_settings, "sliding_attention": local_settings}
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = kv.get(f"{arch}.{field}")
        if cap is not None:
            if not isinstance(cap, float) or not cap > 0:
                raise CkptkitError(f"metadata {arch}.{field} must be a positive float, not {cap!r}")
            out[field] = cap
    return out
