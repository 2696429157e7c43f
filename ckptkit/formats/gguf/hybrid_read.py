"""The hybrid Qwen stacks (Qwen3-Next, Qwen3.5 dense and MoE) read back from llama.cpp's GGUF:
what :mod:`.hybrid` does on writing, undone. The MTP layers come back from the blocks past
``num_hidden_layers``; ``A_log`` from ``-exp(A_log)`` and the norms from ``1 + w`` exactly
(the narrowest dtype whose values give the stored ones, else refused); Qwen3.5's value heads
from tiled back to grouped order; Qwen3-Next's ``attn_qkv`` / ``attn_gate`` fused again into
``in_proj_qkvz``; the conv kernel unsqueezed; experts split from the merged tensors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf import hybrid
from ckptkit.formats.gguf.made import Made, expert

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.gguf.made import Reader
    from ckptkit.models.gguf_spec import GGUFSpec

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _config(kv: dict[str, Any], arch: str, out: dict[str, Any], names: set[str]) -> None:
    """The linear attention's sizes, the layer kinds, the MTP layers, partial (m)rope, experts."""
    get = {k.removeprefix(arch + "."): v for k, v in kv.items() if k.startswith(arch + ".")}
    mtp = int(get.get("nextn_predict_layers") or 0)
    out["num_hidden_layers"] -= mtp
    if mtp:
        out["mtp_num_hidden_layers"] = mtp
    try:
        steps = int(get["ssm.time_step_rank"])
        out |= {
            "linear_conv_kernel_dim": int(get["ssm.conv_kernel"]),
            "linear_key_head_dim": int(get["ssm.state_size"]),
            "linear_num_key_heads": int(get["ssm.group_count"]),
            "linear_num_value_heads": steps,
            "linear_value_head_dim": int(get["ssm.inner_size"]) // steps,
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise CkptkitError(f"metadata lacks or misstates the {arch}.ssm.* keys") from None
    recurrent = get.get("attention.recurrent_layers")
    if isinstance(recurrent, list):
        kinds = recurrent[: out["num_hidden_layers"]]
        out["layer_types"] = ["linear_attention" if r else "full_attention" for r in kinds]
    rope = out["rope_parameters"]
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    rope["partial_rotary_factor"] = int(get.get("rope.dimension_count") or head_dim) / head_dim
    sections = get.get("rope.dimension_sections")
    if arch != "qwen3next" and isinstance(sections, list):  # Qwen3.5: interleaved mRoPE
        rope |= {"mrope_section": list(sections[:3]), "mrope_interleaved": True}
    if "num_local_experts" in out:
        out["num_experts"] = out.pop("num_local_experts")
    if get.get("expert_shared_feed_forward_length") is not None:
        out["shared_expert_intermediate_size"] = int(get["expert_shared_feed_forward_length"])
    if arch == "qwen3next":
        out["mlp_only_layers"] = []  # llama.cpp's qwen3next has experts in every layer


HYBRID_READERS: dict[str, Callable[[dict[str, Any], str, dict[str, Any], set[str]], None]] = {
    "qwen3next": _config,
    "qwen35": _config,
    "qwen35moe": _config,
}


def made(
    reader: Reader, tmap: Any, name: str, shape: tuple[int, ...], config: dict[str, Any], spec: GGUFSpec, layers: int
) -> Made | None:
    """The HF tensor ``name`` of a hybrid stack from the GGUF tensors it was written as."""
    from ckptkit.formats.gguf.tensors import gguf_name

    hf_name = hybrid.llama_cpp_name(name, layers)
    if m := _EXPERT.fullmatch(hf_name):
        return expert(reader, f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight", int(m.group(2)))
    h = {**config, **config.get("text_config", {})}
    if hf_name.endswith("in_proj_qkvz.weight"):
        return _qkvz(reader, hf_name, shape, h)
    key = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias" if hf_name.endswith(".dt_bias") else hf_name
    new = gguf_name(tmap, key) or hybrid.nextn_name(hf_name)
    if new is None or not reader.has(new):
        return None
    tiled = spec.linear_attention == "tiled"
    undo = _undo(hf_name, h, tiled)
    if undo is None:
        return reader.renamed(new)
    info = reader.info(new)
    dtype = info.dtype
    if hybrid.arithmetic(hf_name):
        dtype = _exact_dtype(reader, new, hf_name, undo, h, tiled)
    return Made(shape, dtype, lambda: _narrow(undo(reader.raw.read(new).float()), dtype).reshape(shape))


def _undo(name: str, h: dict[str, Any], reorder: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The inverse of :func:`hybrid.transform` for ``name`` (None: it did nothing)."""
    import torch

    kh, vh = int(h["linear_num_key_heads"]), int(h["linear_num_value_heads"])
    kd, vd = int(h["linear_key_head_dim"]), int(h["linear_value_head_dim"])
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if name.endswith(".A_log"):
        steps.append(lambda t: torch.log(-t.double()).float())
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        steps.append(lambda t: (t.double() - 1).float())
    if reorder and kh != vh and "linear_attn." in name:
        qk = 2 * kh * kd
        if ".in_proj_qkv." in name or ".conv1d" in name:
            steps.append(lambda t: torch.cat([t[:qk], _grouped(t[qk:], 0, kh, vd)]))
        elif ".in_proj_z." in name:
            steps.append(lambda t: _grouped(t, 0, kh, vd))
        elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            steps.append(lambda t: _grouped(t, 0, kh, 1))
        elif ".out_proj." in name:
            steps.append(lambda t: _grouped(t, 1, kh, vd))
    if ".conv1d" in name:
        steps.append(lambda t: t.unsqueeze(1))
    if not steps:
        return None

    def apply(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t.contiguous()

    return apply


def _grouped(t: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """:func:`hybrid.tiled` undone: value heads from tiled back to grouped by key head."""
    per_k = t.shape[dim] // head_dim // k_heads
    return hybrid.tiled(t, dim, per_k, head_dim)


_NARROW = ("bfloat16", "float16", "float32")


def _exact_dtype(
    reader: Reader, gguf: str, name: str, undo: Callable[[torch.Tensor], torch.Tensor], h: dict[str, Any], tiled: bool
) -> str:
    """The narrowest dtype whose values of the undone tensor, transformed again as llama.cpp
    transforms them (bfloat16 in float32), give the stored tensor bit for bit; else refused."""
    import torch

    stored = reader.raw.read(gguf).float()
    forward = hybrid.transform(name, h, tiled)
    assert forward is not None  # an arithmetic transform
    for dtype in _NARROW:
        w = _narrow(undo(stored), dtype)
        again = forward(w.float() if dtype == "bfloat16" else w).float()
        if torch.equal(again.reshape(-1).view(torch.int32), stored.reshape(-1).view(torch.int32)):
            return dtype
    raise CkptkitError(
        f"{reader.raw.root / reader.raw.config_name}: {gguf}: no {', '.join(_NARROW)} {name} gives the stored "
        "values as llama.cpp computes them; it cannot be read back exactly"
    )


def _narrow(t: torch.Tensor, dtype: str) -> torch.Tensor:
    import torch

    return t.to(getattr(torch, dtype))


def _qkvz(reader: Reader, name: str, shape: tuple[int, ...], h: dict[str, Any]) -> Made:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads, their gates) from
    llama.cpp's ``attn_qkv`` (every q, every k, every v) and ``attn_gate``."""
    bid = name.split(".")[2]
    qkv, gate = reader.info(f"blk.{bid}.attn_qkv.weight"), reader.info(f"blk.{bid}.attn_gate.weight")
    kh, vh = int(h["linear_num_key_heads"]), int(h["linear_num_value_heads"])
    kd, vd = int(h["linear_key_head_dim"]), int(h["linear_value_head_dim"])
    per = vh // kh * vd

    def get() -> torch.Tensor:
        import torch

        a, z = reader.raw.read(qkv.name), reader.raw.read(gate.name)
        cols = a.shape[-1]
        q, k, v = a.split([kh * kd, kh * kd, kh * per])
        heads = [t.reshape(kh, -1, cols) for t in (q, k, v, z)]
        return torch.cat(heads, dim=1).reshape(shape)

    return Made(shape, qkv.dtype, get)
