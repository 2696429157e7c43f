"""A synthetic Hugging Face checkpoint with Llama-2-7B tensor shapes and N decoder layers.

Hidden 4096, 32 heads, intermediate 11008, vocab 32000, bf16, random data shaped like
trained weights: one shard for the embeddings, one per layer, one for the final norm and
``lm_head``, plus ``model.safetensors.index.json`` and a ``config.json`` that ckptkit
detects as ``llama2``. Tensors are generated one at a time and each shard is written with
``safetensors`` on its own, so building needs about one shard of memory (~0.5 GB). 32
layers is the real Llama-2-7B: 13.5 GB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Llama-2-7B
HIDDEN = 4096
HEADS = 32
INTERMEDIATE = 11008
VOCAB = 32000
DTYPE = torch.bfloat16

MB = 1_000_000


# --- building the synthetic checkpoint -------------------------------------------------


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.v_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def shard_plan(layers: int) -> list[dict[str, tuple[int, ...]]]:
    """Tensor names and shapes per shard: embeddings, one shard per layer, norm + lm_head."""
    shards: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (VOCAB, HIDDEN)}]
    shards += [layer_shapes(i) for i in range(layers)]
    shards.append({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    return shards


def random_tensor(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 data shaped like trained weights: norms near 1, matrices ~N(0, 0.02)."""
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(DTYPE)
    out = torch.empty(shape, dtype=DTYPE)
    rows = max(1, (64 * MB) // (4 * shape[1]))  # fp32 scratch of at most 64 MB
    for start in range(0, shape[0], rows):
        chunk = out[start : start + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=gen).mul_(0.02))
    return out


def config_json(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": HEADS,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def build_hf(root: Path, layers: int, seed: int) -> tuple[int, int]:
    """Write the synthetic checkpoint; returns (total bytes, largest tensor bytes)."""
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shards = shard_plan(layers)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = largest = params = 0
    for i, shapes in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {k: random_tensor(s, gen) for k, s in shapes.items()}
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.nbytes
            params += t.numel()
            largest = max(largest, t.nbytes)
        del tensors
    index = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (root / "config.json").write_text(json.dumps(config_json(layers), indent=2, sort_keys=True) + "\n")
    return total, largest
