"""Shared helpers for the native-model tests: fixtures as ckptkit and transformers models."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from click.testing import Result

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FAMILIES = ["llama2", "llama3", "llama3_1", "llama3_2", "mistral", "qwen2", "gemma", "phi3"]
# Parity bound for float32 logits vs transformers (the brief's 1e-5; we measure exact 0.0).
TOL = 1e-5


def hf_dir(family: str) -> Path:
    """The bundled HF fixture of ``family`` (committed: a missing one fails the test)."""
    return FIXTURES / "hf" / family


@functools.cache
def _load(family: str) -> tuple[Any, dict[str, torch.Tensor]]:
    import ckptkit

    return ckptkit.load_checkpoint(str(hf_dir(family)))


def fixture_config(family: str) -> Any:
    return _load(family)[0]


def native_model(family: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The fixture's weights in ckptkit's model, config fields overridden as given."""
    from ckptkit.train.transformer import build_model

    cfg, sd = _load(family)
    common = {f.name for f in dataclasses.fields(cfg)}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if k in common})
    cfg = cfg.replace_fields(**{k: v for k, v in overrides.items() if k not in common})
    model = build_model(cfg, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    return model.eval()


def hf_model(family: str, dtype: torch.dtype = torch.float32, **rope_overrides: Any) -> Any:
    """The fixture in transformers' ``AutoModelForCausalLM``; ``rope_overrides`` patch
    ``config.rope_parameters`` (``sliding_window=...`` sets that config field instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir(family))
    for key, value in rope_overrides.items():
        if key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
            setattr(config, key, value)
        else:
            config.rope_parameters[key] = value
    model = AutoModelForCausalLM.from_pretrained(hf_dir(family), config=config, dtype=dtype)
    return model.eval()


def padded_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens: full, left-padded by 5, right-padded by 3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 9:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def ckptkit(*args: str) -> Result:
    """``ckptkit ARGS`` in this process: the CLI's own app, exit codes and one-line errors, with
    no interpreter and torch to start (seconds of CPU each)."""
    from typer.testing import CliRunner

    from ckptkit.cli import app

    return CliRunner().invoke(app, list(args))


def one_layer_llama(folder: Path, hidden: int, head_dim: int) -> Path:
    """A one-layer bf16 Llama in ``folder`` (HF safetensors, the llama2 fixture's config and
    tokenizer; intermediate size ``2 * hidden``): random linears (x 0.05, seed 0), embeddings
    and output, unit norms; sizes NF4 can block when ``hidden`` is a multiple of 128."""
    import json
    import shutil

    from safetensors.torch import save_file

    inter = 2 * hidden
    config = json.loads((hf_dir("llama2") / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inter, head_dim=head_dim, num_hidden_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.0.{k}.weight": torch.randn(s, generator=gen) * 0.05 for k, s in shapes.items()}
    tensors |= {"model.embed_tokens.weight": torch.randn(384, hidden, generator=gen),
                "lm_head.weight": torch.randn(384, hidden, generator=gen) * 0.05}  # fmt: skip
    norms = ("model.norm", "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm")
    tensors |= {f"{k}.weight": torch.ones(hidden) for k in norms}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / "model.safetensors", {"format": "pt"})
    for f in hf_dir("llama2").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, folder)
    return folder
