"""Llama 4 to GGUF as llama.cpp's ``llama4`` writes it: byte for byte its
``convert_hf_to_gguf.py`` output for every outtype, from the causal LM and from Meta's
multimodal release (its vision tower left to ``--mmproj``), the stacked experts transposed
and ``gate_up_proj`` split; read back (llama.cpp's GGUF and ours) to the source's tensors, with
the config of the model llama.cpp runs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_family_helpers import assert_reads_back, llama_cpp_references
from test_gguf import OUTTYPES, assert_same_gguf

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

TEXT, RELEASE = FIXTURES / "hf" / "llama4-text", FIXTURES / "hf" / "llama4"
PRE = "llama-bpe"  # the fixtures' tokenizer has Llama 3's split; llama.cpp cannot know its hash
CHUNKED, FULL = "chunked_attention", "full_attention"
# What llama.cpp's llama4 runs whatever config.json says (llama-model.cpp: n_no_rope_layer_step
# 4, set_swa_pattern(4) with n_swa 8192, attention temperature floor 8192): no GGUF key holds
# them. The fixtures say otherwise (NoPE in layers 1 and 3, chunks of 5, floor 4) to test HF.
LLAMA_CPP_RUNS = {
    "no_rope_layers": [1, 1, 1, 0],
    "layer_types": [CHUNKED, CHUNKED, CHUNKED, FULL],
    "attention_chunk_size": 8192,
    "floor_scale": 8192,
}
# a GGUF's read back is the causal LM, without the release's vision config and wrapper fields
TEXT_ONLY = frozenset({"multimodal", "vision_config", "wrapper"})


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    """llama.cpp's GGUF of an HF folder for an outtype, every outtype from one converter process."""
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


def edited(src: Path, out: Path, **text: Any) -> Path:
    """A copy of the HF folder ``src`` (same name, under ``out``) with these text config fields."""
    dst = out / src.name
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (config.get("text_config") or config).update(text)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_hf_to_gguf_equals_llama_cpp(
    src: Path, dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    ours = tmp_path / "ours.gguf"
    opts = ConvertOptions("gguf", gguf_pre=PRE, dtype=dtype, allow_lossy_cast=dtype is not None)
    convert(src, ours, opts)
    assert_same_gguf(ours, reference(src, dtype))


def _stored(folder: Path) -> dict[str, Any]:
    """The tensors of an HF folder, as stored."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out |= load_file(p)
    return out


def test_experts_transposed_and_split_the_dense_width_and_the_towers_left_out(tmp_path: Path) -> None:
    import torch
    from gguf import GGUFReader

    result = convert(RELEASE, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    reader = GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    text = json.loads((RELEASE / "config.json").read_text())["text_config"]
    keys = {k.removeprefix("llama4."): f.contents() for k, f in reader.fields.items() if k.startswith("llama4.")}
    assert keys["feed_forward_length"] == text["intermediate_size_mlp"] == 56
    assert keys["expert_feed_forward_length"] == text["intermediate_size"] == 24
    assert keys["interleave_moe_layer_step"] == 2 and keys["expert_count"] == 4
    assert "attention.sliding_window" not in keys  # chunked layers: llama.cpp's fixed 8192
    assert not any(n.startswith(("v.", "mm.")) for n in tensors) and len(tensors) == 47

    stored, prefix = _stored(RELEASE), "language_model.model.layers.1."
    layer = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
    towers = [k for k in stored if k.startswith(("vision_model.", "multi_modal_projector."))]
    gate, up = layer["feed_forward.experts.gate_up_proj"].transpose(1, 2).chunk(2, dim=1)  # [E, H, 2I] halves

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.int16).numpy().tobytes()

    assert tensors["blk.1.ffn_gate_exps.weight"].data.tobytes() == raw(gate)
    assert tensors["blk.1.ffn_up_exps.weight"].data.tobytes() == raw(up)
    assert tensors["blk.1.ffn_down_exps.weight"].data.tobytes() == raw(layer["feed_forward.experts.down_proj"].mT)
    shared = layer["feed_forward.shared_expert.gate_proj.weight"]
    assert tensors["blk.1.ffn_gate_shexp.weight"].data.tobytes() == raw(shared)
    router = layer["feed_forward.router.weight"].float().numpy().tobytes()  # llama.cpp keeps routers in F32
    assert tensors["blk.1.ffn_gate_inp.weight"].data.tobytes() == router
    assert tuple(tensors["blk.0.ffn_gate.weight"].shape) == (40, 56)  # a dense layer: intermediate_size_mlp
    notes = " ".join(result.notes)
    assert f"{len(towers)} tensor(s) of the vision (or audio) tower not written: llama.cpp writes them" in notes
    assert "attention_chunk_size 5 (llama.cpp assumes 8192), floor_scale 4 (llama.cpp assumes 8192)" in notes


@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
def test_gguf_reads_back_to_the_model_llama_cpp_runs(src: Path, tmp_path: Path) -> None:
    """What the GGUF cannot hold changes no byte of it; read back, it gives the source's
    tensors and, with llama.cpp's NoPE layers and chunks, the source's logits exactly."""
    runs = edited(src, tmp_path / "runs", **LLAMA_CPP_RUNS)
    for folder, name in ((src, "fixture.gguf"), (runs, "runs.gguf")):
        convert(folder, tmp_path / name, ConvertOptions("gguf", gguf_pre=PRE, dtype="bfloat16"))
    assert (tmp_path / "fixture.gguf").read_bytes() == (tmp_path / "runs.gguf").read_bytes()
    assert_reads_back(tmp_path / "fixture.gguf", runs, tmp_path / "hf", ignored=TEXT_ONLY)


@pytest.mark.slow
@pytest.mark.parametrize("src", [TEXT, RELEASE], ids=["text", "release"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llama_cpp_gguf_reads_back_to_the_model_it_runs(
    src: Path, dtype: str, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    runs = edited(src, tmp_path / "runs", **LLAMA_CPP_RUNS)
    assert_reads_back(reference(src, dtype), runs, tmp_path / "hf", ignored=TEXT_ONLY)


def test_a_release_s_config_with_llama_cpp_s_settings_gets_no_note(tmp_path: Path) -> None:
    """Meta's releases leave ``no_rope_layers`` empty (transformers' default: every 4th layer
    NoPE) and have no ``layer_types``: nothing llama.cpp runs otherwise."""
    runs = {"no_rope_layers": [], "layer_types": None, "attention_chunk_size": 8192, "floor_scale": 8192}
    result = convert(edited(TEXT, tmp_path, **runs), tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    assert not [n for n in result.notes if "GGUF has no key" in n]
    src = edited(TEXT, tmp_path / "interval", **runs, no_rope_layer_interval=2)
    result = convert(src, tmp_path / "i.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    assert [n for n in result.notes if "no_rope_layer_interval 2 (llama.cpp assumes 4)" in n]


def test_all_full_attention_is_sliding_window_0_and_rope_in_every_layer(tmp_path: Path) -> None:
    """llama.cpp's converter writes ``sliding_window`` 0 where every layer is full attention
    (MobileLLM); llama.cpp then ropes every layer, which the read-back config says."""
    from gguf import GGUFReader

    src = edited(TEXT, tmp_path, layer_types=[FULL] * 4, no_rope_layers=[1] * 4)
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    keys = [k for k in GGUFReader(tmp_path / "m.gguf").fields if k.startswith("llama4.")]
    assert keys[-1] == "llama4.attention.sliding_window"  # the last key Llama4Model adds
    assert GGUFReader(tmp_path / "m.gguf").fields[keys[-1]].contents() == 0
    convert(tmp_path / "m.gguf", tmp_path / "hf", ConvertOptions("hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["layer_types"] == [FULL] * 4 and config["no_rope_layers"] == [1] * 4


def test_scout_s_rope_scaling_is_rope_freqs_read_back(tmp_path: Path) -> None:
    """Llama 4 Scout's Llama 3 rope scaling (factor 16, low and high frequency factors 1):
    ``rope_freqs.weight`` 1 where the wavelength is under the original context, 16 above it."""
    import math

    import torch
    from gguf import GGUFReader

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    src = edited(TEXT, tmp_path, rope_parameters=rope)
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    freqs = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}["rope_freqs.weight"].data.tolist()
    inv = 1.0 / (500000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))
    assert freqs == [1.0 if 2 * math.pi / f < 8192 else 16.0 for f in inv.tolist()] and 16.0 in freqs
    convert(tmp_path / "m.gguf", tmp_path / "hf", ConvertOptions("hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"] == rope
