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
