"""``--dtype`` never overflows silently, counts what underflows into one note, and ``--verify``
after a cast says what it checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES, tree_hashes

PROBE = "model.layers.0.mlp.down_proj.weight"


def _hf_with(root: Path, values: list[float]) -> Path:
    """A tiny bf16 Llama saved by transformers, with ``values`` written into one weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():  # every value well inside float16's normal range
            param.copy_(torch.where(param < 0, -1.0, 1.0) * param.abs().clamp(min=2.0**-10))
        weight = model.get_parameter(PROBE)
        weight.view(-1)[: len(values)] = torch.tensor(values, dtype=torch.bfloat16)
    model.save_pretrained(root)
    return root


@pytest.mark.parametrize(("to", "name"), [("hf", PROBE), ("meta", "layers.0.feed_forward.w2.weight")])
def test_overflow_is_an_error_naming_the_tensor(to: str, name: str, tmp_path: Path) -> None:
    src = _hf_with(tmp_path / "src", [1e6, 1e-9])
    before = tree_hashes(src)
    with pytest.raises(CkptkitError) as err:
        convert(src, tmp_path / "out", ConvertOptions(to, dtype="float16"))
    message = str(err.value)
    assert message.startswith(f"{name}: casting to float16, 1 value(s) overflow to inf (largest magnitude 999424)")
    assert "--allow-lossy-cast" in message and "\n" not in message
    assert not (tmp_path / "out").exists() and tree_hashes(src) == before
    assert not list(tmp_path.glob(".out.*"))


# bfloat16 values and what float16 makes of them (its smallest subnormal is 2**-24, its
# smallest normal 2**-14): 0 (two), a subnormal other than the value (two), or the value.
UNDERFLOWING = [
    1e-9,  # -> 0
    -1e-9,  # -> -0
    2.0**-20,  # a float16 subnormal exactly: nothing lost
    2.0**-20 * (1 + 2.0**-7),  # -> 2**-20: the low bit is under float16's subnormal step
    3e-8,  # -> 2**-24
    2.0**-14,  # float16's smallest normal
    0.0,
    -3.5,
]


def test_underflow_is_one_note_with_exact_counts_and_torch_s_bytes(tmp_path: Path) -> None:
    """Values under float16's range are what a float16 cast makes of them, counted over the
    whole conversion into one note (this tensor's 2 + 2, and 1 more to 0 in another)."""
    src = _hf_with(tmp_path / "src", UNDERFLOWING)
    source = load_file(src / "model.safetensors")
    source["model.norm.weight"][3] = 1e-9
    save_file(source, src / "model.safetensors", metadata={"format": "pt"})
    for to in ("hf", "meta"):
        result = convert(src, tmp_path / to, ConvertOptions(to, dtype="float16", verify=True))
        casts = [n for n in result.notes if n.startswith("casting to")]
        assert casts == [
            "casting to float16: 3 non-zero value(s) underflow to 0 and 2 round to a subnormal, in 2 tensor(s) "
            "(as torch and llama.cpp cast them); to keep every bit of them, convert without --dtype or with "
            "--dtype float32"
        ], to
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in source.items():
        assert torch.equal(got[name].view(torch.int16), t.to(torch.float16).view(torch.int16)), name
    probe = got[PROBE].view(-1)[: len(UNDERFLOWING)]
    assert probe.tolist() == [0.0, -0.0, 2.0**-20, 2.0**-20, 2.0**-24, 2.0**-14, 0.0, -3.5]
    assert torch.signbit(probe[1])


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


def _float16_underflows(folder: Path) -> tuple[int, int, int]:
    """(values to 0, values to a subnormal other than they were, tensors holding either) of
    casting a bf16 folder's 2-D tensors (those GGUF stores in the file type) to float16,
    by numpy: bf16 bits widened to float32, numpy's float16 cast."""
    import numpy as np

    zeros = subnormals = tensors = 0
    for f in sorted(folder.glob("*.safetensors")):
        for t in load_file(f).values():
            if t.dim() != 2:
                continue
            wide = (t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
            half = wide.astype(np.float16)
            z = int(((half == 0) & (wide != 0)).sum())
            sub = (half != 0) & (np.abs(half) < np.finfo(np.float16).smallest_normal)
            s = int((half[sub].astype(np.float64) != wide[sub].astype(np.float64)).sum())
            zeros, subnormals, tensors = zeros + z, subnormals + s, tensors + bool(z or s)
    return zeros, subnormals, tensors


def test_gguf_float16_of_a_real_bf16_model_is_written_with_one_note(tmp_path: Path) -> None:
    """The Mistral fixture (like real bf16 models) holds a value under float16's smallest
    subnormal and more under its normal range: written as torch's float16 cast, one note
    with the counts numpy gives; a value that overflows is still refused."""
    from gguf import GGUFReader

    src = FIXTURES / "hf" / "mistral"
    zeros, subnormals, tensors = _float16_underflows(src)
    assert (zeros, subnormals) == (1, 23)  # measured (353 values lie under 2**-14; most fit a subnormal)
    result = convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", dtype="float16"))
    assert [n for n in result.notes if n.startswith("casting to")] == [
        f"casting to float16: {zeros} non-zero value(s) underflow to 0 and {subnormals} round to a subnormal, "
        f"in {tensors} tensor(s) (as torch and llama.cpp cast them); to keep every bit of them, convert without "
        "--dtype or with --dtype float32"
    ]
    stored = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
    embed = load_file(src / "model-00001-of-00003.safetensors")["model.embed_tokens.weight"]
    assert stored["token_embd.weight"].data.tobytes() == embed.to(torch.float16).numpy().tobytes()

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = load_file(bad / "model-00001-of-00003.safetensors")
    shard["model.embed_tokens.weight"][0, 0] = 1e6
    save_file(shard, bad / "model-00001-of-00003.safetensors", metadata={"format": "pt"})
    with pytest.raises(CkptkitError, match=r"^token_embd\.weight: casting to float16, 1 value\(s\) overflow to inf"):
        convert(bad, tmp_path / "bad.gguf", ConvertOptions("gguf", dtype="float16"))
    assert not (tmp_path / "bad.gguf").exists()
