"""``--dtype`` never changes values silently, and ``--verify`` after a cast says what it checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import tree_hashes

PROBE = "model.layers.0.mlp.down_proj.weight"


def _hf_with(root: Path, values: list[float]) -> Path:
    """A tiny bf16 Llama saved by transformers, with ``values`` written into one weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        weight = model.get_parameter(PROBE)
        weight.view(-1)[: len(values)] = torch.tensor(values, dtype=torch.bfloat16)
    model.save_pretrained(root)
    return root


@pytest.mark.parametrize(("value", "problem"), [(1e6, "overflow to inf"), (1e-9, "flush to 0")])
def test_lossy_cast_is_an_error_naming_the_tensor(value: float, problem: str, tmp_path: Path) -> None:
    src = _hf_with(tmp_path / "src", [value])
    before = tree_hashes(src)
    with pytest.raises(CkptkitError) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf", dtype="float16"))
    message = str(err.value)
    assert PROBE in message and problem in message and "--allow-lossy-cast" in message and "\n" not in message
    assert not (tmp_path / "out").exists() and tree_hashes(src) == before
    assert not list(tmp_path.glob(".out.*"))


def test_allow_lossy_cast_writes_what_torch_casts(tmp_path: Path) -> None:
    src = _hf_with(tmp_path / "src", [1e6, 1e-9, -3.5])
    convert(src, tmp_path / "out", ConvertOptions("hf", dtype="float16", allow_lossy_cast=True, verify=True))
    got = load_file(tmp_path / "out" / "model.safetensors")[PROBE].view(-1)[:3]
    assert torch.isinf(got[0]) and got[1] == 0 and got[2] == -3.5


def test_exact_casts_need_no_flag(tmp_path: Path) -> None:
    """bf16 -> fp32 is exact; bf16 -> fp16 only rounds (no overflow, no flush) for ordinary
    weights: both run without the flag and write what torch's cast gives, read back by
    safetensors and torch.load (Meta's q/k rows are permuted: compared as sorted values)."""
    src = _hf_with(tmp_path / "src", [0.5, -2.0, 1e-3])
    source = load_file(src / "model.safetensors")
    convert(src, tmp_path / "f32", ConvertOptions("hf", dtype="float32", verify=True))
    f32 = load_file(tmp_path / "f32" / "model.safetensors")
    assert f32.keys() == source.keys()
    for k, v in source.items():
        assert f32[k].dtype == torch.float32 and torch.equal(f32[k], v.float()), k
        assert torch.equal(f32[k].to(torch.bfloat16).view(torch.int16), v.view(torch.int16)), k  # lossless
    assert f32[PROBE].view(-1)[:3].tolist() == [0.5, -2.0, torch.tensor(1e-3, dtype=torch.bfloat16).item()]
    convert(src, tmp_path / "f16", ConvertOptions("meta", dtype="float16", verify=True))
    meta = torch.load(tmp_path / "f16" / "consolidated.00.pth", weights_only=True)
    assert {t.dtype for t in meta.values()} == {torch.float16}
    assert meta["layers.0.feed_forward.w2.weight"].equal(source[PROBE].to(torch.float16))  # down_proj: not permuted

    def values(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return tuple(t.shape), tuple(sorted(t.flatten().tolist()))

    cast = {values(v.to(torch.float16)) for v in source.values()}  # the output ties to the embeddings
    assert {values(t) for k, t in meta.items() if k != "rope.freqs"} == cast  # Meta adds its rope.freqs


def test_cli_verify_after_cast_says_what_it_verified(tmp_path: Path) -> None:
    src = _hf_with(tmp_path / "src", [0.5])
    run = [sys.executable, "-m", "ckptkit", "convert", str(src)]
    res = subprocess.run(
        [*run, str(tmp_path / "a"), "--to", "hf", "--dtype", "float32", "--verify"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "verified bitwise" not in res.stderr
    assert "verified: every tensor equals the source cast to float32" in res.stderr
    res = subprocess.run([*run, str(tmp_path / "b"), "--to", "meta", "--verify"], capture_output=True, text=True)
    assert res.returncode == 0 and "verified bitwise against the source" in res.stderr
