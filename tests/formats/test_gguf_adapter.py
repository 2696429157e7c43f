"""LoRA adapters written as llama.cpp's LoRA GGUF equal what its ``convert_lora_to_gguf.py`` writes.

Adapters are made by PEFT itself (``get_peft_model`` on the tiny HF fixtures, seeded, A and B
both random so that a permutation applied to the wrong half shows) and by ckptkit's trainer.
The reference is llama.cpp's script from the llama-cpp-python sdist; both files are compared
with ``test_gguf``'s GGUFReader helpers. Where the script fails, or writes what llama.cpp
cannot load, the expectation is PEFT's own tensors under llama.cpp's documented naming and
Q/K permutation (computed here), or a one-line refusal with nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gguf import assert_same_gguf

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES
from reference_cache import cached_outputs

OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    out: Path,
    family: str,
    targets: list[str],
    dtype: torch.dtype = torch.float32,
    **lora: Any,
) -> Path:
    """A PEFT LoRA adapter of ``fixtures/hf/<family>``, A and B random (seeded), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = FIXTURES / "hf" / family if "/" not in family else Path(family)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **lora)
    peft_model = get_peft_model(model, config).to(dtype)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".modules_to_save." in name:  # trained: no longer the base's
                p.add_(torch.randn_like(p) * 0.01)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The PEFT adapters, made once per session."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "llama3": make_adapter(root / "llama3", "llama3", ALL),
        "llama2-bf16": make_adapter(root / "llama2-bf16", "llama2", ["q_proj", "k_proj", "v_proj"], torch.bfloat16),
        "qwen2-f16": make_adapter(root / "qwen2-f16", "qwen2", ["q_proj", "k_proj", "o_proj"], torch.float16),
        "llama3-ends": make_adapter(root / "llama3-ends", "llama3", ["q_proj", "k_proj", "embed_tokens", "lm_head"]),
        "llama3_1": make_adapter(root / "llama3_1", "llama3_1", ["q_proj", "k_proj", "down_proj"]),
    }


def llama_cpp_lora(llama_cpp: Path, adapter: Path, base: Path, out: Path, outtype: str | None) -> Path:
    cmd = [sys.executable, "convert_lora_to_gguf.py", str(adapter), "--base", str(base), "--outfile", str(out)]
    cmd += ["--outtype", outtype] if outtype is not None else []  # None: the script's own default

    def run() -> None:
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        res = subprocess.run(cmd, cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    cached_outputs([adapter, base], [cmd[1], *cmd[7:]], [out], run)  # llama.cpp's run for these inputs, made once
    return out


CASES = [  # adapter, base fixture, --dtype
    ("llama3", "llama3", None),
    ("llama3", "llama3", "float16"),
    ("llama2-bf16", "llama2", "q8_0"),
    ("qwen2-f16", "qwen2", "bfloat16"),
    ("llama3-ends", "llama3", None),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "family", "dtype"), CASES)
def test_peft_adapter_gguf_equals_llama_cpp(
    name: str, family: str, dtype: str | None, adapters: dict[str, Path], llama_cpp: Path, tmp_path: Path
) -> None:
    """Same keys, tensors, GGML types and bytes: Llama 2 (heads) and Llama 3 (grouped KV
    heads) permute Q/K, Qwen2 does not; float32/bfloat16/float16 adapters, every --dtype."""
    base = FIXTURES / "hf" / family
    convert(
        adapters[name],
        tmp_path / "ours.gguf",
        ConvertOptions("gguf", dtype=dtype, base=base, allow_lossy_cast=dtype is not None),
    )
    theirs = llama_cpp_lora(llama_cpp, adapters[name], base, tmp_path / "theirs.gguf", OUTTYPES.get(dtype or ""))
    assert_same_gguf(tmp_path / "ours.gguf", theirs)


@pytest.mark.slow
def test_a_llama_3_1_adapter_converts_with_the_hf_base_or_its_gguf(
    adapters: dict[str, Path], llama_cpp: Path, tmp_path: Path
) -> None:
    """A Llama 3.1 base (rope scaling; its GGUF holds rope_freqs): the adapter holds no rope_freqs,
    and a GGUF of the base serves as --base as well as the HF folder."""
    import shutil

    from gguf import GGUFReader

    base = FIXTURES / "hf" / "llama3_1"
    # llama.cpp knows no pre-tokenizer for this fixture's BPE tokenizer: its GGUF gets Llama 2's
    # (an adapter's GGUF holds no vocabulary)
    renamed = shutil.copytree(base, tmp_path / "llama3_1", ignore=shutil.ignore_patterns("tokenizer*"))
    for f in (FIXTURES / "hf" / "llama2").glob("tokenizer*"):
        shutil.copy(f, renamed)
    convert(renamed, tmp_path / "base.gguf", ConvertOptions("gguf"))
    assert "rope_freqs.weight" in [t.name for t in GGUFReader(tmp_path / "base.gguf").tensors]
    theirs = llama_cpp_lora(llama_cpp, adapters["llama3_1"], base, tmp_path / "theirs.gguf", None)
    for i, b in enumerate((base, tmp_path / "base.gguf")):
        convert(adapters["llama3_1"], tmp_path / f"ours{i}.gguf", ConvertOptions("gguf", base=b))
        assert_same_gguf(tmp_path / f"ours{i}.gguf", theirs)


@pytest.mark.slow
def test_the_trainers_lora_output_converts_without_base_as_llama_cpp_does_it(llama_cpp: Path, tmp_path: Path) -> None:
    """The trainer's adapter names a local HF base (here an HF copy of a Meta base): no --base needed."""
    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import recipe_entry

    common = ["epochs=1", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={FIXTURES / 'meta' / 'llama2'}"]
    recipe_entry("lora_finetune")(
        load_config("tiny_lora", [*common, "quiet=true", f"checkpointer.output_dir={tmp_path}"])
    )
    adapter = tmp_path / "epoch_0" / "adapter"
    base = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    convert(adapter, tmp_path / "ours.gguf", ConvertOptions("gguf"))
    assert_same_gguf(tmp_path / "ours.gguf", llama_cpp_lora(llama_cpp, adapter, base, tmp_path / "theirs.gguf", None))


def _permute(b: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (Meta's interleaved pairs) from HF's rotate-half order, as its
    ``LlamaModel.permute`` documents it: per head, rows (0, n/2, 1, n/2 + 1, ...)."""
    per = b.shape[0] // heads
    order = [h * per + (j // 2 if j % 2 == 0 else per // 2 + j // 2) for h in range(heads) for j in range(per)]
    return b[order]


def _gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader

    return {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(path).tensors}


def test_lora_on_the_embeddings_and_output_layer_holds_peft_tensors(tmp_path: Path) -> None:
    """token_embd: A transposed (llama.cpp gathers its rows by token), B as PEFT has it; output:
    A and B as PEFT has them; q/k: B's rows permuted, A never."""
    from safetensors.torch import load_file

    family = "llama3"
    adapter = make_adapter(tmp_path / "a", family, ["q_proj", "k_proj", "embed_tokens", "lm_head"])
    convert(adapter, tmp_path / "a.gguf", ConvertOptions("gguf", base=FIXTURES / "hf" / family))
    got = _gguf_tensors(tmp_path / "a.gguf")
    peft = {k.removeprefix("base_model.model."): v for k, v in load_file(adapter / "adapter_model.safetensors").items()}
    cfg = json.loads((FIXTURES / "hf" / family / "config.json").read_text())
    heads = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}
    want = {
        "token_embd.weight.lora_a": peft["model.embed_tokens.lora_embedding_A"].T,
        "token_embd.weight.lora_b": peft["model.embed_tokens.lora_embedding_B"],
        "output.weight.lora_a": peft["lm_head.lora_A.weight"],
        "output.weight.lora_b": peft["lm_head.lora_B.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        for x in "qk":
            b = peft[f"model.layers.{i}.self_attn.{x}_proj.lora_B.weight"]
            want[f"blk.{i}.attn_{x}.weight.lora_a"] = peft[f"model.layers.{i}.self_attn.{x}_proj.lora_A.weight"]
            want[f"blk.{i}.attn_{x}.weight.lora_b"] = _permute(b, heads[x])
            assert b.abs().min() > 0  # B is random: a permutation that is wrong shows
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.contiguous()), name


def _refused(tmp_path: Path, match: str, src: Path, **kw: Any) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CkptkitError, match=match) as e:
        convert(src, tmp_path / "out.gguf", ConvertOptions(kw.pop("to", "gguf"), **kw))
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


TIED = [("lm_head", "lm_head.weight.*output layer is its embeddings"), ("embed_tokens", "output layer too.*merge")]


@pytest.mark.parametrize(("target", "match"), TIED)
def test_lora_on_the_output_layer_or_embeddings_of_a_tied_model_is_refused(
    target: str, match: str, tmp_path: Path
) -> None:
    """Qwen2's output layer is its embeddings: its GGUF has no output.weight to adapt, and
    llama.cpp applies a token_embd.weight LoRA to the output layer as well (llama.cpp's script
    writes both, which llama.cpp cannot load or run)."""
    adapter = make_adapter(tmp_path / "a", "qwen2", ["q_proj", target])
    _refused(tmp_path, match, adapter, base=FIXTURES / "hf" / "qwen2")


def test_modules_to_save_says_to_merge_then_convert(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    adapter = make_adapter(tmp_path / "a", "llama3", ["q_proj"], modules_to_save=["embed_tokens"])
    _refused(
        tmp_path,
        r"modules_to_save: model.embed_tokens.weight.*ckptkit merge BASE",
        adapter,
        base=FIXTURES / "hf" / "llama3",
    )
    result = CliRunner().invoke(app, ["convert", str(adapter), str(tmp_path / "out.gguf"), "--to", "gguf",
                                      "--base", str(FIXTURES / "hf" / "llama3")])  # fmt: skip
    assert result.exit_code == 1
    assert "ckptkit merge" in result.output and "--to gguf" in result.output
    assert not (tmp_path / "out.gguf").exists()


def test_modules_to_save_and_embedding_lora_merge_as_peft_merges_them_then_convert(tmp_path: Path) -> None:
    """The way to a GGUF that the refusal names: ckptkit merge (equal to PEFT's merge_and_unload
    of the same adapter), then --to gguf."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ckptkit.train.export import merge_adapter_into_checkpoint

    base = tmp_path / "base"
    convert(FIXTURES / "hf" / "llama2", base, ConvertOptions("hf", dtype="float32"))  # float32: one rounding, as PEFT's
    adapter = make_adapter(tmp_path / "a", str(base), ["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    merge_adapter_into_checkpoint(base, adapter, tmp_path / "merged")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    theirs = peft.merge_and_unload().state_dict()
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert not torch.equal(theirs[key], original[key]), key
    assert ours.keys() == theirs.keys()
    assert max((v - theirs[k]).abs().max().item() for k, v in ours.items()) < 1e-6
    convert(tmp_path / "merged", tmp_path / "merged.gguf", ConvertOptions("gguf"))
    assert (tmp_path / "merged.gguf").stat().st_size > 0


def _edited(adapter: Path, out: Path, **changes: Any) -> Path:
    """A copy of ``adapter`` with adapter_config.json fields changed."""
    import shutil

    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | changes))
    return out


def test_the_base_comes_from_a_local_base_model_name_or_path_or_base(adapters: dict[str, Path], tmp_path: Path) -> None:
    local = _edited(adapters["llama3"], tmp_path / "local", base_model_name_or_path=str(FIXTURES / "hf" / "llama3"))
    convert(local, tmp_path / "local.gguf", ConvertOptions("gguf"))
    convert(adapters["llama3"], tmp_path / "given.gguf", ConvertOptions("gguf", base=FIXTURES / "hf" / "llama3"))
    assert_same_gguf(tmp_path / "local.gguf", tmp_path / "given.gguf")
    convert(
        adapters["llama3"], tmp_path / "meta.gguf", ConvertOptions("gguf", base=FIXTURES / "meta" / "llama3")
    )  # any format
    assert_same_gguf(tmp_path / "meta.gguf", tmp_path / "given.gguf")
    with pytest.raises(CkptkitError, match="LoRA adapter GGUF"):  # read back: no model in it
        convert(tmp_path / "meta.gguf", tmp_path / "hf", ConvertOptions("hf"))
    hub = _edited(adapters["llama3"], tmp_path / "hub", base_model_name_or_path="meta-llama/Llama-3.2-1B")
    _refused(tmp_path, r"'meta-llama/Llama-3.2-1B'.*not a local folder.*pass --base BASE", hub)


def test_a_bin_adapter_gives_the_gguf_of_its_safetensors(adapters: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = adapters["llama2-bf16"]
    binary = _edited(src, tmp_path / "bin")
    torch.save(load_file(src / "adapter_model.safetensors"), binary / "adapter_model.bin")
    (binary / "adapter_model.safetensors").unlink()
    base = FIXTURES / "hf" / "llama2"
    convert(binary, tmp_path / "bin.gguf", ConvertOptions("gguf", base=base, dtype="q8_0"))
    convert(src, tmp_path / "st.gguf", ConvertOptions("gguf", base=base, dtype="q8_0"))
    assert_same_gguf(tmp_path / "bin.gguf", tmp_path / "st.gguf")


def test_rslora_is_written_with_the_alpha_that_scales_as_it_does(tmp_path: Path) -> None:
    """llama.cpp scales by alpha / rank; rsLoRA by alpha / sqrt(rank)."""
    from gguf import GGUFReader

    adapter = make_adapter(tmp_path / "a", "qwen2", ["q_proj"], use_rslora=True)
    convert(adapter, tmp_path / "a.gguf", ConvertOptions("gguf", base=FIXTURES / "hf" / "qwen2"))
    alpha = GGUFReader(tmp_path / "a.gguf").fields["adapter.lora.alpha"].contents()
    assert alpha / 4 == pytest.approx(8 / 4**0.5)


def test_bad_adapters_and_options_are_one_line_and_nothing_written(adapters: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    llama3, base = adapters["llama3"], FIXTURES / "hf" / "llama3"
    _refused(
        tmp_path, "hidden size|is \\[32, 64\\] in the adapter, \\[64, 64\\]", llama3, base=FIXTURES / "hf" / "llama2"
    )
    _refused(tmp_path, "--to hf takes models.*--to gguf.*ckptkit merge", llama3, to="hf", base=base)
    _refused(tmp_path, "--base applies to a LoRA adapter SRC", base, base=base)
    _refused(tmp_path, "--verify applies to checkpoints", llama3, base=base, verify=True)
    half = _edited(llama3, tmp_path / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.q_proj.lora_B" not in k},
              half / "adapter_model.safetensors")  # fmt: skip
    _refused(tmp_path, "layers.1.self_attn.q_proj.weight has lora_A but no lora_B", half, base=base)
    (half / "adapter_model.safetensors").unlink()
    _refused(tmp_path, "has no adapter_model.safetensors", half, base=base)
    dora = _edited(llama3, tmp_path / "dora", use_dora=True)
    _refused(tmp_path, "DoRA", dora, base=base)
    convert(llama3, tmp_path / "out.gguf", ConvertOptions("gguf", base=base))
    _refused(tmp_path, "exists", llama3, base=base, dtype="q8_0")
