"""Gemma 4 to GGUF as llama.cpp's ``gemma4`` writes it: byte for byte its
``convert_hf_to_gguf.py`` output for every outtype, from the causal LM (per-layer embeddings,
KV-shared layers with a double-wide MLP) and from the multimodal release (experts, full layers
with their own KV heads and keys as values; its towers left to ``--mmproj``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_family_helpers import llama_cpp_references
from test_gguf import OUTTYPES, assert_same_gguf

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

TEXT, RELEASE = FIXTURES / "hf" / "gemma4-text", FIXTURES / "hf" / "gemma4"


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    """llama.cpp's GGUF of an HF folder for an outtype, every outtype from one converter process."""
    return llama_cpp_references(llama_cpp, tmp_path_factory, "")


@pytest.mark.slow
@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_hf_to_gguf_equals_llama_cpp(
    src: Path, dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    ours = tmp_path / "ours.gguf"
    convert(src, ours, ConvertOptions("gguf", dtype=dtype, allow_lossy_cast=dtype is not None))
    assert_same_gguf(ours, reference(src, dtype))


def test_layers_of_two_kinds_and_renamed_tensors(tmp_path: Path) -> None:
    import json

    import torch
    from gguf import GGUFReader
    from safetensors import safe_open

    convert(RELEASE, tmp_path / "m.gguf", ConvertOptions("gguf"))
    r = GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in r.tensors}
    text = json.loads((RELEASE / "config.json").read_text())["text_config"]
    full = text["rope_parameters"]["full_attention"]
    head = text["per_layer_config"]["2"]["head_dim"]
    rotated = int(head * full["partial_rotary_factor"]) // 2
    freqs = tensors["rope_freqs.weight"].data.tolist()
    assert freqs == [1.0] * rotated + [pytest.approx(1e30)] * (head // 2 - rotated)
    assert r.fields["gemma4.attention.sliding_window_pattern"].contents() == [
        t == "sliding_attention" for t in text["layer_types"]
    ]
    assert r.fields["gemma4.attention.head_count_kv"].contents() == [2, 2, 1]
    assert r.fields["tokenizer.ggml.model"].contents() == "gemma4"
    assert not any(n.startswith(("v.", "a.")) or "vision" in n or "audio" in n for n in tensors)
    stored = {}
    for p in sorted(RELEASE.glob("*.safetensors")):
        with safe_open(p, "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys() if ".layers.1." in k and "language_model" in k}
    layer = "model.language_model.layers.1."

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.int16).numpy().tobytes()

    assert tensors["blk.1.ffn_gate_up_exps.weight"].data.tobytes() == raw(stored[layer + "experts.gate_up_proj"])
    assert tensors["blk.1.ffn_down_exps.weight"].data.tobytes() == raw(stored[layer + "experts.down_proj"])
    for gguf_name, hf in (
        ("ffn_down_exps.scale", "router.per_expert_scale"),
        ("ffn_gate_inp.scale", "router.scale"),
        ("layer_output_scale.weight", "layer_scalar"),
        ("attn_norm.weight", "input_layernorm.weight"),  # as stored: Gemma 4 norms scale by w, not 1 + w
    ):
        assert tensors[f"blk.1.{gguf_name}"].data.tobytes() == stored[layer + hf].float().numpy().tobytes()


def test_a_full_rope_llama_cpp_does_not_write_is_one_line(tmp_path: Path) -> None:
    import json
    import shutil

    from ckptkit.errors import CkptkitError

    src = tmp_path / "src"
    shutil.copytree(TEXT, src)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["full_attention"]["rope_type"] = "default"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CkptkitError, match="llama.cpp writes only 'proportional' rope .* not 'default'$"):
        convert(src, tmp_path / "m.gguf", ConvertOptions("gguf"))


def _text_tensors(folder: Path) -> dict[str, Any]:
    """The text model's tensors of an HF folder, under the causal LM's names."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out |= load_file(p)
    towers = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
    return {k.replace("language_model.", ""): v for k, v in out.items() if not k.startswith(towers)}


def assert_reads_back(src: Path, gguf_file: Path, out: Path) -> None:
    """``gguf_file`` read back as HF: the source text model's tensors, their values bit for bit
    (float32 widened from the source's bfloat16 where the GGUF is f32), a config.json that
    transformers loads, and for the causal LM the source's float32 logits exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    convert(gguf_file, out, ConvertOptions("hf"))
    want, got = _text_tensors(src), _text_tensors(out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name].to(value.dtype), value) and torch.equal(got[name].float(), value.float()), name
    ids = torch.tensor([[1, 5, 9, 22, 7, 3, 100, 41]])
    logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    if src == TEXT:
        source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        assert source.abs().max() > 0 and (logits - source).abs().max().item() == 0.0


@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
def test_gguf_reads_back_to_the_source(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", dtype="bfloat16"))
    assert_reads_back(src, tmp_path / "m.gguf", tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_cpp_gguf_reads_back_to_the_source(
    src: Path, dtype: str, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    assert_reads_back(src, reference(src, dtype), tmp_path / "hf")
