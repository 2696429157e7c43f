"""A GGUF is a checkpoint wherever one is read: ``merge`` into it gives a GGUF of the same
tensor types, training takes it as its base (dequantized at load) and writes its checkpoints
back in GGUF by the same rule, ``generate`` uses the tokenizer it holds.

The GGUFs are ckptkit's (equal to llama.cpp's converter's, tests/formats/test_gguf.py) of the
HF llama2 fixture, in its own bf16 and in Q8_0; references are built by way of HF folders:
merging into the HF model (or its dequantized copy) and converting that to GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.formats.gguf.reader import read_header
from ckptkit.train.config import load_config
from ckptkit.train.generation import generate_text
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.tokenizer import load_tokenizer

from train_helpers import hf_dir

FAMILY = "llama2"


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """Each tensor of a GGUF as (GGML type, stored bytes), read off the file by its header."""
    header = read_header(path)
    data = path.read_bytes()
    return {t.name: (t.kind, data[t.offset : t.offset + t.nbytes]) for t in header.tensors}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The llama2 fixture as GGUF: as stored (bf16) and in Q8_0."""
    out = tmp_path_factory.mktemp("gguf")
    made = {"bf16": out / "bf16" / f"{FAMILY}.gguf", "q8_0": out / "q8_0" / f"{FAMILY}.gguf"}
    for kind, path in made.items():
        convert(hf_dir(FAMILY), path, ConvertOptions("gguf", dtype=None if kind == "bf16" else "q8_0"))
    return made


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter (non-zero B) on q, v and down of the llama2 fixture."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("adapter") / "adapter"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(hf_dir(FAMILY), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    model.save_pretrained(out)
    return out


def merge(base: Path, adapter: Path, dst: Path) -> None:
    result = CliRunner().invoke(app, ["merge", str(base), str(adapter), str(dst)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_merge_into_a_gguf_is_a_gguf_of_its_types_equal_to_merging_into_hf(
    kind: str, ggufs: dict[str, Path], adapter: Path, tmp_path: Path
) -> None:
    """bf16: merging into the HF source and converting gives the same file, bit for bit. Q8_0:
    merging into the GGUF's dequantized HF copy (float32) and converting with --dtype q8_0
    does; every tensor keeps its type, and those the adapter leaves keep their bytes (a Q8_0
    block dequantized and quantized again is the same block)."""
    base = ggufs[kind]
    merge(base, adapter, tmp_path / "merged.gguf")

    hf = hf_dir(FAMILY)
    if kind == "q8_0":
        hf = tmp_path / "dequantized"
        convert(base, hf, ConvertOptions("hf", dtype="float32"))
    merge(hf, adapter, tmp_path / "merged-hf")
    again = ConvertOptions("gguf", dtype="q8_0" if kind == "q8_0" else None)
    convert(tmp_path / "merged-hf", tmp_path / "ref.gguf", again)

    ours, ref, before = tensors(tmp_path / "merged.gguf"), tensors(tmp_path / "ref.gguf"), tensors(base)
    assert ours == ref
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in before.items()}
    assert {v[0] for v in ours.values()} == ({"BF16", "F32"} if kind == "bf16" else {"Q8_0", "F32"})
    changed = {k for k in ours if ours[k] != before[k]}
    assert changed == {f"blk.{i}.{w}.weight" for i in range(2) for w in ("attn_q", "attn_v", "ffn_down")}
    assert (
        read_header(tmp_path / "merged.gguf").metadata["general.file_type"]
        == (read_header(base).metadata["general.file_type"])
    )


def test_generate_from_a_gguf_uses_its_tokenizer_and_gives_the_hf_model_s_tokens(ggufs: dict[str, Path]) -> None:
    """The tokenizer rebuilt from the GGUF encodes as the fixture's own (transformers'), and
    greedy decoding from the GGUF gives transformers' tokens on the HF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    theirs = AutoTokenizer.from_pretrained(hf_dir(FAMILY))
    ids = theirs(prompt).input_ids
    assert load_tokenizer(ggufs["bf16"]).encode(prompt) == ids
    model = AutoModelForCausalLM.from_pretrained(hf_dir(FAMILY), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = theirs.decode(out[0], skip_special_tokens=True)
    assert generate_text(str(ggufs["bf16"]), prompt, max_new_tokens=12) == expected


def test_merge_of_a_gguf_into_a_folder_path_is_one_line(ggufs: dict[str, Path], adapter: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["merge", str(ggufs["bf16"]), str(adapter), str(tmp_path / "merged")])
    assert result.exit_code == 2  # bad usage, as convert's
    assert result.output == f"error: {tmp_path / 'merged'}: --to gguf writes one file; name DST ending in .gguf\n"
    assert not (tmp_path / "merged").exists()


def test_chat_with_a_gguf_that_has_no_template_is_one_line(ggufs: dict[str, Path]) -> None:
    with pytest.raises(CkptkitError, match=r"llama2\.gguf: holds no chat template; drop --chat"):
        generate_text(str(ggufs["bf16"]), "hi", max_new_tokens=2, chat=True)


def test_training_on_a_gguf_base_writes_gguf_checkpoints_of_its_types(ggufs: dict[str, Path], tmp_path: Path) -> None:
    """Full fine-tuning from the Q8_0 GGUF trains what its dequantized copy trains (the same
    first loss, bitwise) and writes each checkpoint as a GGUF of the base's name and types; a
    LoRA run's final merged GGUF is what ``merge`` of its adapter into the base writes."""
    common = ["epochs=1", "max_steps_per_epoch=1", "quiet=true"]
    base = ggufs["q8_0"]
    convert(base, tmp_path / "dequantized", ConvertOptions("hf", dtype="float32"))
    for name, source in (("gguf", base), ("hf", tmp_path / "dequantized")):
        overrides = [*common, f"checkpointer.checkpoint_dir={source}", f"checkpointer.output_dir={tmp_path / name}"]
        recipe_entry("full_finetune")(load_config("tiny_full", overrides))
    losses = [json.loads((tmp_path / n / "metrics.jsonl").read_text().splitlines()[1])["loss"] for n in ("gguf", "hf")]
    assert losses[0] == losses[1]
    written = tmp_path / "gguf" / "epoch_0" / base.name
    assert sorted(p.name for p in written.parent.iterdir()) == [base.name]  # final: no recipe state
    assert {k: v[0] for k, v in tensors(written).items()} == {k: v[0] for k, v in tensors(base).items()}

    out = tmp_path / "lora"
    overrides = [*common, f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={out}"]
    recipe_entry("lora_finetune")(load_config("tiny_lora", overrides))
    merge(base, out / "epoch_0" / "adapter", tmp_path / "merged.gguf")
    assert (out / "epoch_0" / base.name).read_bytes() == (tmp_path / "merged.gguf").read_bytes()


def test_tensor_types_ckptkit_does_not_write_are_noted() -> None:
    """A base of mixed types (as llama-quantize writes them): each tensor gets its own type
    where ckptkit writes it; one whose rows do not divide into its blocks is written in the file
    type's, and a note says so."""
    import gguf

    from ckptkit.formats.gguf.gguf_tensor import GGUFTensor
    from ckptkit.formats.gguf.mix import keep_types

    q = gguf.GGMLQuantizationType
    planned = [GGUFTensor(f"blk.0.{w}.weight", (64, 64), q.BF16, torch.zeros) for w in ("attn_q", "attn_k", "attn_v")]
    kinds = {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q4_0"}
    notes = keep_types(planned, kinds, "base.gguf")
    assert [q(t.qtype).name for t in planned] == ["Q8_0", "BF16", "Q4_0"]  # rows of 64: no Q4_K block of 256
    assert notes == [
        "base.gguf: ckptkit writes GGUF tensors as BF16, F16, F32, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, "
        "Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ1_0, TQ2_0, in rows of whole blocks; tensors of other types or rows "
        "written Q4_K as BF16; to quantize them as before, run llama.cpp's llama-quantize on the output"
    ]


@pytest.mark.slow
def test_two_processes_train_on_a_gguf_base_and_write_gguf_checkpoints(ggufs: dict[str, Path], tmp_path: Path) -> None:
    """FSDP2 on 2 gloo processes: rank 0 converts each checkpoint's model from the shards into a
    GGUF of the base's name and types."""
    import subprocess
    import sys

    base, out = ggufs["q8_0"], tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "run", "full_finetune_distributed", "--nproc-per-node", "2",
         "--config", "tiny_full_distributed", "epochs=2", "max_steps_per_epoch=1", "quiet=true",
         f"checkpointer.checkpoint_dir={base}", f"checkpointer.output_dir={out}"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for epoch in ("epoch_0", "epoch_1"):
        written = tensors(out / epoch / base.name)
        assert {k: v[0] for k, v in written.items()} == {k: v[0] for k, v in tensors(base).items()}
