"""llama.cpp's ``convert_hf_to_gguf.py`` accepts what ``ckptkit convert meta->hf`` writes, and
what it writes from a bf16 or f16 HF model comes back as that model, dtypes included.

The converter comes from the ``llama-cpp-python`` sdist on PyPI (vendor/llama.cpp), fetched
once with pip into a cache directory (``CKPTKIT_TEST_CACHE``, default: the system temp
dir); only the converters, their ``conversion`` package, ``gguf-py`` and the Llama
vocabularies are unpacked (``tokenizer_helpers.llama_cpp_dir``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_sections import kv_values
from safetensors.torch import load_file
from test_gguf import all_moe_qwen3, llama_cpp_gguf

from ckptkit.convert import ConvertOptions, convert
from ckptkit.verify import verify_paths

from conftest import FIXTURES
from reference_cache import cached_outputs
from tokenizer_helpers import write_tiny_meta_llama3


def _to_gguf(llama_cpp: Path, hf_dir: Path, out: Path) -> dict[str, object]:
    """Run the converter; return the tokenizer metadata of the GGUF it wrote."""
    cmd = [sys.executable, "convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out)]

    def run() -> None:
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        res = subprocess.run(cmd, cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    cached_outputs([hf_dir], cmd[1:2], [out], run)  # llama.cpp's run for these inputs, made once
    fields = kv_values(out)  # as GGUFReader reads them (test_gguf.py), without its minute on Llama 3's vocabulary
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    return {k: fields[k] for k in keys if k in fields}


@pytest.mark.slow
def test_llama3_meta_to_hf_converts_to_gguf(llama_cpp: Path, tmp_path: Path) -> None:
    write_tiny_meta_llama3(tmp_path / "meta")
    convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))
    meta = _to_gguf(llama_cpp, tmp_path / "hf", tmp_path / "model.gguf")
    # "llama-bpe": llama.cpp recognised Llama 3's pre-tokenizer from how the tokenizer encodes its probe text.
    assert meta == {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128001,
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama2", "mistral"])
def test_sentencepiece_meta_to_hf_converts_to_gguf(family: str, llama_cpp: Path, tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / family, tmp_path / "hf", ConvertOptions("hf"))
    meta = _to_gguf(llama_cpp, tmp_path / "hf", tmp_path / "model.gguf")
    assert meta["tokenizer.ggml.model"] == "llama"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)


def _run_llama_cpp(llama_cpp: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    res = subprocess.run([sys.executable, *args], cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_trainer_outputs_of_a_meta_base_convert_with_llama_cpp(llama_cpp: Path, tmp_path: Path) -> None:
    """A LoRA adapter of a Meta base names an HF copy llama.cpp's LoRA converter reads; an
    intermediate Meta checkpoint keeps its recipe state where the legacy converter does not look."""
    import json

    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import recipe_entry

    src = str(FIXTURES / "meta" / "llama2")
    common = ["epochs=2", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={src}", "quiet=true"]
    recipe_entry("lora_finetune")(load_config("tiny_lora", [*common, f"checkpointer.output_dir={tmp_path / 'lora'}"]))
    adapter = tmp_path / "lora" / "epoch_1" / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    _run_llama_cpp(llama_cpp, "convert_lora_to_gguf.py", str(adapter), "--base", base, "--outfile",
                   str(tmp_path / "lora.gguf"))  # fmt: skip
    recipe_entry("full_finetune")(load_config("tiny_full", [*common, f"checkpointer.output_dir={tmp_path / 'full'}"]))
    intermediate = tmp_path / "full" / "epoch_0"
    assert (intermediate / "recipe_state" / "recipe_state.pt").is_file()
    _run_llama_cpp(llama_cpp, "examples/convert_legacy_llama.py", str(intermediate), "--outfile",
                   str(tmp_path / "full.gguf"))  # fmt: skip


# Every HF fixture llama.cpp's converter takes, with the pre-tokenizer it is told for the tiny
# byte-level BPE tokenizers whose hash it cannot know (as in test_gguf.py). The Qwen3-MoE
# fixture has dense layers, which llama.cpp's qwen3moe lacks: all_moe_qwen3 stands in for it;
# llama.cpp's llama class cannot read mixtral-stacked's stacked experts (test_gguf.py).
READ_BACK = {
    "llama2": None, "llama3": "llama-bpe", "llama3_1": "llama-bpe", "llama3_2": "llama-bpe", "mistral": None,
    "gemma": None, "gemma2": None, "gemma3_text": None, "phi3": None, "qwen2": "qwen2", "qwen3": "qwen2",
    "qwen3_moe": "qwen2", "olmo2": "llama-bpe", "mixtral": None,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", list(READ_BACK))
def test_llama_cpp_bf16_and_f16_ggufs_convert_back_identical(family: str, llama_cpp: Path, tmp_path: Path) -> None:
    """llama.cpp widens norms, biases and MoE routers to F32 in a bf16 or f16 GGUF; read back
    (--to hf, no --dtype) they are in the file type's dtype again, and the folder verifies
    IDENTICAL against the HF folder llama.cpp read: the bf16 fixture for --outtype bf16, its
    float16 copy (every value a float16's; in a folder of the family's name, which llama.cpp
    writes as general.name: Mistral is told from Llama by it) for --outtype f16.

    Except Gemma's norms from float16: llama.cpp widens only dtypes other than float16 to
    float32 before its transforms, so it adds Gemma's 1 to a float16 norm in float16, and the
    GGUF holds 1 + w rounded to float16's step near 1: w is lost, each norm (only they) comes
    back within that rounding (2**-11) of it."""
    src = all_moe_qwen3(tmp_path / "moe")["per-expert"] if family == "qwen3_moe" else FIXTURES / "hf" / family
    f16 = tmp_path / "float16" / family
    convert(src, f16, ConvertOptions("hf", dtype="float16"))
    for outtype, origin in (("bf16", src), ("f16", f16)):
        gguf = llama_cpp_gguf(llama_cpp, origin, tmp_path / f"{outtype}.gguf", outtype, READ_BACK[family])
        convert(gguf, tmp_path / f"back-{outtype}", ConvertOptions("hf"))
        report = verify_paths(origin, tmp_path / f"back-{outtype}")
        if outtype == "f16" and family.startswith("gemma"):
            norms = {k for f in origin.glob("*.safetensors") for k in load_file(f) if k.endswith("norm.weight")}
            assert {d.name_b for d in report.differences} == norms  # measured: every norm, by up to 2**-11
            assert all(d.kind == "values" and (d.max_abs_diff or 0) <= 2**-11 for d in report.differences)
            continue
        assert report.verdict().startswith("IDENTICAL"), f"{outtype}: {report.verdict()}"
