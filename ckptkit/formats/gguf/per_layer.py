"""Keys and tensors of llama.cpp models whose layers differ from one another (Gemma 4):
per-layer arrays of feed-forward widths and KV heads, head sizes of the full and the sliding
layers apart, and the ``rope_freqs.weight`` that leaves part of each full-attention head
unrotated. Written as its converter writes them; read back into config.json fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    import torch

SLIDING, FULL = "sliding_attention", "full_attention"
UNROTATED = 1e30  # llama.cpp's frequency factor for a pair of dimensions rope leaves as they are


def _full_layer_field(h: dict[str, Any], field: str) -> Any:
    """``field`` of the first full-attention layer ``per_layer_config`` gives it for (its order)."""
    types = h.get("layer_types") or []
    for index, own in (h.get("per_layer_config") or {}).items():
        i = int(index)
        if i < len(types) and types[i] == FULL and field in own:
            return own[field]
    return None


def full_head_dim(h: dict[str, Any]) -> int:
    """The full-attention layers' head size: ``global_head_dim``, else ``per_layer_config``'s."""
    found = h.get("global_head_dim")
    if found is None:
        found = _full_layer_field(h, "head_dim")
    if found is None:
        raise CkptkitError("config.json gives the full-attention layers no head size (global_head_dim)")
    return int(found)


def full_kv_heads(h: dict[str, Any]) -> int | None:
    """The full-attention layers' KV heads, where config.json gives them a count of their own."""
    found = h.get("num_global_key_value_heads")
    return _full_layer_field(h, "num_key_value_heads") if found is None else found


def _sliding(h: dict[str, Any]) -> list[bool]:
    return [t == SLIDING for t in h["layer_types"]]


def _feed_forward(w: Any, h: dict[str, Any]) -> None:
    """One width, or per layer where the KV-shared layers' MLP is twice as wide."""
    n_ff, layers = h["intermediate_size"], h["num_hidden_layers"]
    if not h.get("use_double_wide_mlp"):
        w.add_feed_forward_length(n_ff)
        return
    first_shared = layers - h["num_kv_shared_layers"]
    w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(layers)])


def _kv_heads(w: Any, h: dict[str, Any]) -> None:
    """The sliding layers' KV heads, per layer where the full layers have a count of their own."""
    full, swa = full_kv_heads(h), h.get("num_key_value_heads")
    if full is not None and swa is not None:
        w.add_head_count_kv([swa if s else full for s in _sliding(h)])
    else:
        w.add_head_count_kv(h.get("num_key_value_heads", 4))


def _lengths(w: Any, h: dict[str, Any], swa: bool) -> None:
    d = h["head_dim"] if swa else full_head_dim(h)
    (w.add_key_length_swa if swa else w.add_key_length)(d)
    (w.add_value_length_swa if swa else w.add_value_length)(d)


def _rope_dims(w: Any, h: dict[str, Any]) -> None:
    """Every dimension of a full head (``rope_freqs`` unrotates some); of a sliding head, the
    part the top-level ``rope_parameters`` gives (llama.cpp's reading: all of it)."""
    top = h.get("rope_parameters", h.get("rope_scaling")) or {}
    w.add_rope_dimension_count(full_head_dim(h))
    w.add_rope_dimension_count_swa(int(h["head_dim"] * top.get("partial_rotary_factor", 1.0)))


def _expert_width(h: dict[str, Any]) -> Any:
    return next((h[f] for f in ("expert_intermediate_size", "moe_intermediate_size") if h.get(f) is not None), None)


def _first(h: dict[str, Any], fields: tuple[str, ...]) -> Any:
    return next((h[f] for f in fields if h.get(f) is not None), None)


EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERTS_USED = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")

# name: (write, the config.json field whose absence skips a "name?" key), as params.WRITERS
WRITERS: dict[str, tuple[Any, str | None]] = {
    "feed_forward_length_per_layer": (lambda w, h, t: _feed_forward(w, h), None),
    "head_count_kv_per_layer": (lambda w, h, t: _kv_heads(w, h), None),
    "expert_count_given": (lambda w, h, t: w.add_expert_count(_first(h, EXPERTS)), "experts_given"),
    "expert_used_count_given": (
        lambda w, h, t: w.add_expert_used_count(_first(h, EXPERTS_USED)),
        "experts_used_given",
    ),
    "head_dim_full": (lambda w, h, t: _lengths(w, h, False), None),
    "shared_kv_layers": (lambda w, h, t: w.add_shared_kv_layers(h["num_kv_shared_layers"]), None),
    "embedding_length_per_layer_input": (
        lambda w, h, t: w.add_embedding_length_per_layer_input(h.get("hidden_size_per_layer_input") or 0),
        None,
    ),
    "sliding_window_pattern": (lambda w, h, t: w.add_sliding_window_pattern(_sliding(h)), None),
    "head_dim_swa": (lambda w, h, t: _lengths(w, h, True), None),
    "expert_feed_forward_length_given": (
        lambda w, h, t: w.add_expert_feed_forward_length(_expert_width(h)),
        "expert_width",
    ),
    "rope_dimension_count_per_kind": (lambda w, h, t: _rope_dims(w, h), None),
}
PRESENT = {
    "experts_given": lambda h: _first(h, EXPERTS),
    "experts_used_given": lambda h: _first(h, EXPERTS_USED),
    "expert_width": _expert_width,
}


def proportional_rope_freqs(h: dict[str, Any]) -> torch.Tensor:
    """``rope_freqs.weight`` of the full-attention layers' ``proportional`` rope: factor 1 for
    the rotated pairs of dimensions (the first ``partial_rotary_factor`` of them), a factor
    that stops rotation for the rest."""
    import torch

    full = (h.get("rope_parameters") or {}).get(FULL) or {}
    if full.get("rope_type") != "proportional":
        raise CkptkitError(
            f"config.json: llama.cpp writes only 'proportional' rope for the full-attention layers, "
            f"not {full.get('rope_type')!r}"
        )
    pairs = full_head_dim(h) // 2
    rotated = int(full_head_dim(h) * full["partial_rotary_factor"] / 2)
    return torch.tensor([1.0] * rotated + [UNROTATED] * (pairs - rotated), dtype=torch.float32)


# --- reading ------------------------------------------------------------------------------------


def _ints(kv: dict[str, Any], key: str, layers: int) -> list[int] | None:
    """A per-layer array key (or one value for every layer); None when absent."""
    value = kv.get(key)
    if value is None:
        return None
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
        raise CkptkitError(f"metadata {key} must give a positive integer for each of the {layers} layers")
    return values


def _partial_factor(stored: torch.Tensor, head: int) -> float:
    """``partial_rotary_factor`` of the full layers from their ``rope_freqs.weight``."""
    import torch

    values = stored.to(torch.float32)
    rotated = int((values == 1.0).sum())
    if values.numel() != head // 2 or not bool((values[rotated:] == torch.tensor(UNROTATED)).all()):
        raise CkptkitError(
            f"rope_freqs.weight is not {head // 2} factors of 1 then {UNROTATED:g} (Gemma 4's proportional rope)"
        )
    return 2 * rotated / head


def scalar_view(kv: dict[str, Any], arch: str) -> dict[str, Any]:
    """``kv`` with its per-layer arrays as their first value (what the common keys' reader takes)."""
    keys = (f"{arch}.feed_forward_length", f"{arch}.attention.head_count_kv")
    return {k: v[0] if k in keys and isinstance(v, list) and v else v for k, v in kv.items()}


def hparams_from_layers(
    kv: dict[str, Any], arch: str, out: dict[str, Any], rope_freqs: Any, shapes: dict[str, Any]
) -> None:
    """Gemma 4's config.json fields from its per-layer keys, ``rope_freqs()`` (the stored
    ``rope_freqs.weight``) and the tensors' ``shapes`` (by name), into ``out`` (the common fields)."""
    pattern = kv.get(f"{arch}.attention.sliding_window_pattern")
    layers = out["num_hidden_layers"]
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise CkptkitError(f"metadata {arch}.attention.sliding_window_pattern must give each of the {layers} layers")
    types = [SLIDING if s else FULL for s in pattern]
    ff = _ints(kv, f"{arch}.feed_forward_length", layers) or []
    heads_kv = _ints(kv, f"{arch}.attention.head_count_kv", layers) or []
    swa_dim = _ints(kv, f"{arch}.attention.key_length_swa", 1)
    full_dim = _ints(kv, f"{arch}.attention.key_length", 1)
    if not (ff and heads_kv and swa_dim and full_dim):
        raise CkptkitError(f"metadata lacks {arch}.feed_forward_length, head_count_kv or key_length(_swa)")
    swa_kv = next((k for k, t in zip(heads_kv, types, strict=True) if t == SLIDING), heads_kv[0])
    full_kv = next((k for k, t in zip(heads_kv, types, strict=True) if t == FULL), swa_kv)
    own: dict[str, Any] = {"head_dim": full_dim[0]}
    if isinstance(kv.get(f"{arch}.attention.head_count_kv"), list):
        own["num_key_value_heads"] = full_kv
    shared = int(kv.get(f"{arch}.attention.shared_kv_layers") or 0)
    full_rope = {"partial_rotary_factor": _partial_factor(rope_freqs(), full_dim[0]), "rope_type": "proportional"}
    theta = out.get("rope_theta")
    if theta is not None:
        full_rope["rope_theta"] = theta
    local = (out.get("rope_parameters") or {}).get(SLIDING) or {"rope_type": "default"}
    per_layer = kv.get(f"{arch}.embedding_length_per_layer_input") or 0
    out.pop("rope_theta", None)
    out.update(
        head_dim=swa_dim[0],
        intermediate_size=ff[0],
        use_double_wide_mlp=len(set(ff)) > 1,
        num_key_value_heads=swa_kv,
        layer_types=types,
        per_layer_config={str(i): dict(own) for i, t in enumerate(types) if t == FULL},
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer,
        rope_parameters={FULL: full_rope, SLIDING: local},
        attention_k_eq_v=any(
            t == FULL and i < layers - shared and f"blk.{i}.attn_v.weight" not in shapes for i, t in enumerate(types)
        ),
        enable_moe_block=f"{arch}.expert_count" in kv,
    )
    if out["enable_moe_block"]:
        out.update(
            num_experts=kv[f"{arch}.expert_count"],
            top_k_experts=kv.get(f"{arch}.expert_used_count"),
            moe_intermediate_size=kv.get(f"{arch}.expert_feed_forward_length"),
        )
    # the per-layer embeddings' rows; without them unused, given as the vocabulary's
    rows = shapes.get("per_layer_token_embd.weight", shapes.get("token_embd.weight"))
    if rows is not None:
        out["vocab_size_per_layer_input"] = int(rows[0])
    for key in ("num_local_experts", "num_experts_per_tok"):
        out.pop(key, None)
