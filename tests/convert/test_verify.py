"""``ckptkit verify``: a verdict line first, each checkpoint's own tensor names, casts told
apart from changed bytes (verdict CAST; exit 1 as for any difference, 0 with --allow-cast), and --logits."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cli_helpers import ckptkit_in_process
from safetensors.torch import load_file, save_file
from test_errors import copy_fixture, edit_pickle

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

CANONICAL_ONLY = ("layers.0.attn.", "sa_norm", ".scale", "mlp.w1")


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return ckptkit_in_process(*args)


def test_a_widening_cast_is_reported_as_same_values_in_hf_names(tmp_path: Path) -> None:
    convert(FIXTURES / "hf/qwen2", tmp_path / "f32", ConvertOptions("hf", dtype="float32"))
    proc = run("verify", FIXTURES / "hf/qwen2", tmp_path / "f32")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the contract: 1 for any difference
    assert lines[0].startswith("CAST: 0 of 26 tensors bitwise equal, 26 hold the same values in another dtype")
    assert "cast: model.layers.0.self_attn.q_proj.weight: same values, dtype bfloat16 vs float32" in lines
    assert not any(c in proc.stdout for c in CANONICAL_ONLY), proc.stdout
    accepted = run("verify", FIXTURES / "hf/qwen2", tmp_path / "f32", "--allow-cast")
    assert accepted.returncode == 0 and accepted.stdout.startswith("CAST (accepted: --allow-cast)")


def test_a_narrowing_cast_is_reported_as_rounded_not_as_different(tmp_path: Path) -> None:
    convert(FIXTURES / "hf/llama2", tmp_path / "f16", ConvertOptions("hf", dtype="float16", allow_lossy_cast=True))
    proc = run("verify", FIXTURES / "hf/llama2", tmp_path / "f16", "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["verdict"] == "cast" and report["exit_code"] == 1
    kinds = {d["kind"] for d in report["differences"]}
    assert "rounded" in kinds and kinds <= {"cast", "rounded"}
    rounded = next(d for d in report["differences"] if d["kind"] == "rounded")
    assert rounded["name_a"] == rounded["name_b"] and rounded["name_a"].startswith("model.")


def test_changed_bytes_name_the_tensor_in_each_checkpoints_own_layout(tmp_path: Path) -> None:
    src = copy_fixture("meta/llama2", tmp_path / "meta")
    convert(FIXTURES / "meta/llama2", tmp_path / "hf", ConvertOptions("hf"))
    edit_pickle(src / "consolidated.00.pth", lambda t: t.update({"norm.weight": t["norm.weight"] + 1}))
    proc = run("verify", src, tmp_path / "hf", "--allow-cast")  # a value change is never a cast
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1
    assert lines[0] == "DIFFERENT: 20 of 21 tensors bitwise equal, 1 differ in value or shape"
    assert lines[1].startswith("differs: norm.weight (A) / model.norm.weight (B): bytes differ, max abs diff")


def test_a_fused_tensor_is_named_with_its_part(tmp_path: Path) -> None:
    convert(FIXTURES / "hf/phi3", tmp_path / "f32", ConvertOptions("hf", dtype="float32"))
    proc = run("verify", FIXTURES / "hf/phi3", tmp_path / "f32")
    assert "cast: model.layers.0.self_attn.qkv_proj.weight (part 1 of 3): same values" in proc.stdout, proc.stdout


def test_logits_compare_the_models_outputs(tmp_path: Path) -> None:
    convert(FIXTURES / "hf/llama2", tmp_path / "f16", ConvertOptions("meta", dtype="float16", allow_lossy_cast=True))
    proc = run("verify", FIXTURES / "hf/llama2", tmp_path / "f16", "--logits", "--json")
    logits = json.loads(proc.stdout)["logits"]
    assert (logits["prompts"], logits["tokens_per_prompt"], logits["tokens"]) == (4, 64, "corpus")
    assert 0 < logits["max_abs_logit_diff"] < 1e-3 and 0 <= logits["kl_mean"] <= logits["kl_max"] < 1e-6
    same = run("verify", FIXTURES / "hf/llama2", FIXTURES / "hf/llama2", "--logits")
    assert same.returncode == 0
    last = same.stdout.splitlines()[-1]
    assert last.startswith("logits on 4 pieces of 64 tokens of the bundled corpus: max abs diff 0, KL(A||B)")


def _noisy_lm_head(dest: Path) -> Path:
    """A copy of the llama2 fixture whose output projection carries seeded noise of its own
    scale: a model whose next-token distributions differ from the fixture's at every position."""
    shutil.copytree(FIXTURES / "hf/llama2", dest)
    name = "lm_head.weight"
    shard = dest / json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    w = tensors[name].float()
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    tensors[name] = (w + w.std() * noise).to(tensors[name].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return dest


def test_logits_of_a_different_model_are_those_transformers_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KL(A || B) per position over the vocabulary, its mean and max, top-1 agreement and the max
    abs difference, against the same figures computed here from transformers' logits (both on
    the CPU, where the two models' float32 logits are bitwise equal: a GPU would run ckptkit's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from ckptkit.cli import app
    from ckptkit.train.logit_check import CORPUS

    a, b = FIXTURES / "hf/llama2", _noisy_lm_head(tmp_path / "noisy")
    result = CliRunner().invoke(app, ["verify", str(a), str(b), "--logits", "--json"])
    got = json.loads(result.stdout)["logits"]
    # the bundled corpus in the fixture's tokenizer, as the tokenizers library encodes it
    ids = torch.tensor(Tokenizer.from_file(str(a / "tokenizer.json")).encode(CORPUS.read_text()).ids[1:257])
    ids = ids.reshape(4, 64)
    with torch.no_grad():
        la, lb = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(ids).logits.double() for p in (a, b))
    log_pa, log_pb = torch.nn.functional.log_softmax(la, -1), torch.nn.functional.log_softmax(lb, -1)
    kl = torch.nn.functional.kl_div(log_pb, log_pa, reduction="none", log_target=True).sum(-1)  # KL(A || B)
    reverse = torch.nn.functional.kl_div(log_pa, log_pb, reduction="none", log_target=True).sum(-1)
    agree = (la.argmax(-1) == lb.argmax(-1)).double().mean().item()
    assert ids.shape == (got["prompts"], got["tokens_per_prompt"]) == (4, 64)
    assert 0.1 < agree < 0.5  # measured 0.117 (30 of 256): neither all nor none
    assert got["top1_agreement"] == agree
    assert got["max_abs_logit_diff"] == (la - lb).abs().max().item()  # measured 0.686
    # Measured 0.0131899 / 0.0157186 (mean / max).
    assert got["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-12, abs=0)
    assert got["kl_max"] == pytest.approx(kl.max().item(), rel=1e-12, abs=0)
    assert kl.max() > 1.1 * kl.mean() and abs(reverse.max() / kl.max() - 1) > 5e-3


def test_logits_of_a_quantized_gguf_are_those_transformers_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify --logits SRC out.gguf`` on a Q4_0 GGUF: its KL and top-1 agreement against the
    source are those of transformers' logits of the source and of the same file read by its
    GGUF loader (the ``gguf`` package's dequantization), on the bundled corpus."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from ckptkit.cli import app
    from ckptkit.train.logit_check import CORPUS

    a = FIXTURES / "hf/llama2"
    convert(a, tmp_path / "q.gguf", ConvertOptions("gguf", dtype="Q4_0"))
    result = CliRunner().invoke(app, ["verify", str(a), str(tmp_path / "q.gguf"), "--logits", "--json"])
    out = json.loads(result.stdout)
    got = out["logits"]
    ids = torch.tensor(Tokenizer.from_file(str(a / "tokenizer.json")).encode(CORPUS.read_text()).ids[1:257])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)(ids.reshape(4, 64)).logits.double()
        quantized = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32)
        lb = quantized(ids.reshape(4, 64)).logits.double()
    log_pa, log_pb = torch.nn.functional.log_softmax(la, -1), torch.nn.functional.log_softmax(lb, -1)
    kl = torch.nn.functional.kl_div(log_pb, log_pa, reduction="none", log_target=True).sum(-1)
    assert got["tokens"] == "corpus" and 0.5 < got["top1_agreement"] < 1  # measured 0.789 (202 of 256)
    assert got["top1_agreement"] == (la.argmax(-1) == lb.argmax(-1)).double().mean().item()
    assert got["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-12, abs=0)
    assert got["kl_max"] == pytest.approx(kl.max().item(), rel=1e-12, abs=0)
    # its own verdict: the weights held in llama.cpp's types, lossy; the F32 norms the same values
    assert (out["verdict"], out["exit_code"], result.exit_code) == ("ggml-quantized", 1, 1)
    assert {d["kind"] for d in out["differences"]} == {"ggml", "cast"}
    line = CliRunner().invoke(app, ["verify", str(a), str(tmp_path / "q.gguf")]).stdout.splitlines()[0]
    assert line.startswith("GGML-QUANTIZED: 0 of 21 tensors bitwise equal, 16 held in llama.cpp's quantized types")
    assert line.endswith("5 hold the same values in another dtype; --logits measures KL divergence and top-1 agreement")


@pytest.mark.parametrize("fixture", ["hf/llama2", "meta/llama2"])
def test_identical_checkpoints_print_one_line(fixture: str) -> None:
    proc = run("verify", FIXTURES / fixture, FIXTURES / fixture)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == "IDENTICAL: all 21 tensors bitwise equal"
