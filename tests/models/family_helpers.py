"""Shared helpers of the family tests: the CLI's convert in-process, a folder's files and
safetensors tensors, transformers' logits of an HF folder, and the fixture-randomness check."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptkit.checkpoint import Checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
IDS = [5, 17, 200, 3, 99, 311, 42, 7, 250, 1]


def convert(src: Path, dst: Path, to: str, *extra: str) -> None:
    """Run ``ckptkit convert SRC DST --to TO`` in-process; fail the test on a non-zero exit."""
    from typer.testing import CliRunner

    from ckptkit.cli import app

    result = CliRunner().invoke(app, ["convert", str(src), str(dst), "--to", to, "--force", "--quiet", *extra])
    assert result.exit_code == 0, result.output


def files(d: Path) -> dict[str, bytes]:
    """Every file of folder ``d`` (not below it): name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def read_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of folder ``d``."""
    from safetensors.torch import load_file

    return {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(p).items()}


def causal_lm_logits(folder: Path, ids: list[int] = IDS) -> torch.Tensor:
    """transformers' float32 logits of the causal LM in ``folder`` for the token ``ids``
    (its warnings about tensors it drops, an MTP layer or a vision tower, silenced)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def assert_every_tensor_random(ckpt: Checkpoint) -> None:
    """Each tensor of ``ckpt`` has many distinct values (no constant left by a fixture script)."""
    for key, lazy in ckpt.tensors.items():
        t = lazy.get()
        assert t.unique().numel() > min(t.numel() // 2, 3), key


def convert_chain(src: Path, tmp: Path, *steps: str) -> Path:
    """Convert ``src`` through each step (``"to [options...]"``, a folder under ``tmp`` each,
    every step from the previous one's output); the last output."""
    for i, step in enumerate(steps):
        to, *extra = step.split()
        dst = tmp / f"{i}-{to}"
        convert(src, dst, to, *extra)
        src = dst
    return src


def assert_stacked_experts_round_trip(src: Path, tmp: Path) -> None:
    """``src`` (per-expert MoE, its last layer an MTP layer) written with transformers' stacked
    experts gives transformers the same logits, and comes back per expert tensor for tensor."""
    convert(src, tmp / "stacked", "hf", "--experts", "stacked")
    names = set(read_tensors(tmp / "stacked"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.3.mlp.experts.0.up_proj.weight" in names
    assert (causal_lm_logits(tmp / "stacked") - causal_lm_logits(src)).abs().max().item() == 0.0
    convert(tmp / "stacked", tmp / "back", "hf", "--experts", "per-expert")
    want, got = read_tensors(src), read_tensors(tmp / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
