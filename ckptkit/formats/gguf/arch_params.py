"""The config.json fields of the llama.cpp architectures whose own keys
:func:`~ckptkit.formats.gguf.params.hparams_from_metadata` does not read: DeepSeek's latent
attention and grouped experts (``deepseek2``), GLM-4.5's NextN layers counted as blocks
(``glm4moe``), gpt-oss's experts and yarn (``gpt-oss``), Llama 4's two feed-forward widths
and experts' interleave (``llama4``), and the hybrid Qwen stacks' linear attention
(``qwen3next``, ``qwen35``, ``qwen35moe``). Each reads the header's keys (and what its tensor
names say: biases, q/k norms), as llama.cpp's converter wrote them from config.json
(:mod:`.params`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptkit.errors import CkptkitError

Reader = Callable[[dict[str, Any], str, dict[str, Any], set[str]], None]  # (metadata, arch, config, tensor names)


def _get(kv: dict[str, Any], key: str, kind: type = int) -> Any:
    value = kv.get(key)
    if value is not None and (isinstance(value, bool) != (kind is bool) or not isinstance(value, kind)):
        if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
            raise CkptkitError(f"metadata {key} must be {kind.__name__}, not {value!r}")
    return value


def _experts(kv: dict[str, Any], arch: str, out: dict[str, Any]) -> None:
    """DeepSeek V3's expert fields (GLM-4.5 shares them) from TextModel's and its own keys."""
    out["n_routed_experts"] = out.pop("num_local_experts", None)
    for key, name, kind in (
        ("expert_group_count", "n_group", int),
        ("expert_group_used_count", "topk_group", int),
        ("expert_shared_count", "n_shared_experts", int),
        ("leading_dense_block_count", "first_k_dense_replace", int),
        ("expert_weights_scale", "routed_scaling_factor", float),
        ("expert_weights_norm", "norm_topk_prob", bool),
    ):
        value = _get(kv, f"{arch}.{key}", kind)
        if value is not None:
            out[name] = value
    out.setdefault("norm_topk_prob", False)


def _deepseek2(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """Latent attention: llama.cpp's one KV head of ``kv_lora_rank + rope`` dims is the
    model's heads; the head dims from the ``*_mla`` lengths and the rope dims."""
    _experts(kv, arch, out)
    rope_dims = _get(kv, f"{arch}.rope.dimension_count")
    qk, v = _get(kv, f"{arch}.attention.key_length_mla"), _get(kv, f"{arch}.attention.value_length_mla")
    if rope_dims is None or qk is None or v is None or qk <= rope_dims:
        raise CkptkitError(f"metadata lacks or misstates {arch}.rope.dimension_count or the *_mla key/value lengths")
    out.update(
        num_key_value_heads=out["num_attention_heads"],
        head_dim=rope_dims,
        q_lora_rank=_get(kv, f"{arch}.attention.q_lora_rank"),
        kv_lora_rank=_get(kv, f"{arch}.attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dims,
        qk_nope_head_dim=qk - rope_dims,
        qk_head_dim=qk,
        v_head_dim=v,
        num_nextn_predict_layers=0,  # llama.cpp leaves DeepSeek's MTP layers out
        attention_bias=False,
    )
    out["rope_parameters"].pop("partial_rotary_factor", None)


def _glm4moe(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """GLM-4.5: the NextN layers are blocks past ``num_hidden_layers``; rope on part of each head."""
    _experts(kv, arch, out)
    nextn = _get(kv, f"{arch}.nextn_predict_layers") or 0
    out["num_hidden_layers"] -= nextn
    out["num_nextn_predict_layers"] = nextn
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    dims = _get(kv, f"{arch}.rope.dimension_count") or head_dim // 2
    out["rope_parameters"]["partial_rotary_factor"] = dims / head_dim
    out["attention_bias"] = "blk.0.attn_q.bias" in names
    out["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names


def _gpt_oss(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """gpt-oss: its yarn settings (untruncated, as its release states) and expert width."""
    rope = out["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _get(kv, f"{arch}.rope.scaling.{key}", float)
            if value is not None:
                rope[name] = value
        rope["truncate"] = False
    width = _get(kv, f"{arch}.expert_feed_forward_length")
    if width is not None:
        out["intermediate_size"] = width


def _llama4(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """Llama 4: the feed-forward length is the dense layers' (``intermediate_size_mlp``), the
    experts' their own; a ``sliding_window`` of 0 says every layer is full attention."""
    width, step = out.pop("moe_intermediate_size", None), _get(kv, f"{arch}.interleave_moe_layer_step")
    if width is None or step is None or "intermediate_size" not in out:
        raise CkptkitError(
            f"metadata lacks {arch}.feed_forward_length, {arch}.expert_feed_forward_length "
            f"or {arch}.interleave_moe_layer_step"
        )
    out.update(intermediate_size_mlp=out["intermediate_size"], intermediate_size=width, interleave_moe_layer_step=step)
    if out.pop("sliding_window", 0) is None:  # the key, 0: no chunked layers
        out["layer_types"] = ["full_attention"] * out["num_hidden_layers"]


ARCH_READERS: dict[str, Reader] = {"deepseek2": _deepseek2, "glm4moe": _glm4moe, "gpt-oss": _gpt_oss, "llama4": _llama4}


def arch_fields(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """Add (in place) the config.json fields of ``arch``'s own keys to ``out``."""
    from ckptkit.formats.gguf.hybrid_read import HYBRID_READERS

    reader = {**ARCH_READERS, **HYBRID_READERS}.get(arch)
    if reader is not None:
        reader(kv, arch, out, names)
