"""What a user gets wrong is answered in one line that names the option or file, says
what is wrong and what to do."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_helpers import ckptkit_in_process, ckptkit_process

from ckptkit.formats import format_names

from conftest import FIXTURES


def ckptkit(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``ckptkit ARGS`` in this process (tests/cli_helpers.py); the cases marked slow run
    ``python -m ckptkit`` too, for what a process of its own prints."""
    return ckptkit_in_process(*args)


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


CHOICES = {
    "--to huggingface": (
        ["--to", "huggingface"],
        f"error: --to huggingface: not one of {', '.join(format_names())}; did you mean 'hf'?",
    ),
    "--dtype int8": (
        ["--to", "gguf", "--dtype", "int8"],
        "error: --dtype int8: not one of bfloat16, float16, float32, fp8, q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, "
        "Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0; "
        "did you mean 'q8_0'?",
    ),
    "--dtype=fp16": (["--to", "hf", "--dtype=fp16"], "did you mean 'float16'?"),
    "--dtype iq2_xxs": (["--to", "gguf", "--dtype", "iq2_xxs"], "error: --dtype iq2_xxs: not one of bfloat16"),
    "--model-type lama2": (["--to", "hf", "--model-type", "lama2"], "did you mean 'llama2'?"),
}


@pytest.mark.parametrize(("args", "expected"), CHOICES.values(), ids=CHOICES.keys())
def test_an_unknown_choice_lists_the_valid_ones_and_the_nearest(args: list[str], expected: str, tmp_path: Path) -> None:
    line = one_line(ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "o", *args), 2)
    assert expected in line


def test_a_shard_size_without_a_known_unit_explains_the_units(tmp_path: Path) -> None:
    line = one_line(
        ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "o", "--to", "hf", "--max-shard-size", "5gigs"), 2
    )
    assert "--max-shard-size 5gigs: not a size; write a number and one of KB, MB, GB, TB" in line


@pytest.mark.parametrize(("to", "name"), [("meta", "sub"), ("gguf", "model.gguf")])
def test_a_destination_under_a_regular_file_names_that_file(to: str, name: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    line = one_line(ckptkit("convert", FIXTURES / "hf/llama2", tmp_path / "afile" / name, "--to", to), 1)
    assert f"{tmp_path / 'afile'} is a file, not a folder; choose a DST outside it" in line
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize(("to", "name"), [("hf", "out"), ("meta", "out"), ("gguf", "model.gguf")])
def test_a_failed_conversion_leaves_no_folder_it_created(to: str, name: str, tmp_path: Path) -> None:
    """The folders above DST that a conversion creates go again when it fails while
    writing (here: a value that overflows float16, found when its tensor is cast)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "hf/llama2", src)
    last = sorted(src.glob("model-*.safetensors"))[-1]
    with safe_open(last, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(last)
    tensors[sorted(tensors)[-1]].view(-1)[0] = 1e30
    save_file(tensors, last, metadata=metadata)
    line = one_line(ckptkit("convert", src, tmp_path / "new" / "deeper" / name, "--to", to, "--dtype", "float16"), 1)
    assert "overflow to inf" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(("fixture", "config"), [("meta/llama2", "params.json"), ("hf/llama2", "config.json")])
def test_weights_without_their_config_file_name_the_missing_file(fixture: str, config: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, src)
    (src / config).unlink()
    line = one_line(ckptkit("inspect", src), 1)
    assert f"but no {config}; copy the {config} that came with them into the folder" in line


def test_an_unknown_config_key_names_the_yaml_file(tmp_path: Path) -> None:
    ckptkit("cp", "tiny_lora", tmp_path / "my.yaml")
    with (tmp_path / "my.yaml").open("a") as f:
        f.write("\nbogus_key: 1\n")
    line = one_line(ckptkit("run", "lora_finetune", "--config", tmp_path / "my.yaml"), 1)
    assert line.startswith(f"error: {tmp_path / 'my.yaml'}: config: unknown key bogus_key")


# --- a LoRA adapter on a base it was not trained on ------------------------------------------


def _peft_adapter(family: str, out: Path, targets: list[str], **kwargs: object) -> Path:
    """A LoRA adapter saved by PEFT on the transformers model of fixture ``family``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(FIXTURES / "hf" / family)
    get_peft_model(base, LoraConfig(r=4, target_modules=targets)).save_pretrained(out, **kwargs)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # OLMo 2 fixture: hidden size 40, 3 layers (llama2's: 64, 2)
        "olmo2": _peft_adapter("olmo2", root / "olmo2", ["q_proj", "v_proj"]),
        # lm_head adapted, without PEFT's copy of the base layer
        "llama2 lm_head": _peft_adapter("llama2", root / "head", ["q_proj", "lm_head"], save_embedding_layers=False),
        # fewer key/value heads than llama2's (llama3: 2, llama2: 4)
        "llama3 k_proj": _peft_adapter("llama3", root / "kv", ["k_proj"]),
    }


HIDDEN = "adapter for another model: it was trained on a model with hidden size 40; {base} has 64"
WRONG_BASE = {
    "generate, other hidden size": (
        "generate", "olmo2", "llama2", HIDDEN + "; use it with the model it was trained on ({trained_on}"
    ),
    "merge, other hidden size": (
        "merge", "olmo2", "llama2", HIDDEN + "; merge it into the model it was trained on ({trained_on}"
    ),
    "generate, output tied to the embeddings": (
        "generate", "llama2 lm_head", "llama3_2",
        "adapter for another model: the adapter has lm_head; {base} does not (it ties the output projection to "
        "the embeddings); use it with the model it was trained on ({trained_on}",
    ),
    "merge, other number of key/value heads": (
        "merge", "llama3 k_proj", "llama2",
        "adapter for another model: model.layers.0.self_attn.k_proj maps 64 -> 32 features in the adapter, "
        "64 -> 64 in {base}; merge it into",
    ),
    "generate, other model type": (
        "generate", "olmo2", "phi3",
        "adapter for another model: the adapter targets model.layers.0.self_attn.q_proj, which a phi3 model does "
        "not have; use it with",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("command", "adapter", "base", "expected"), WRONG_BASE.values(), ids=WRONG_BASE.keys())
def test_an_adapter_on_another_base_names_the_adapter_the_mismatch_and_the_fix(
    command: str, adapter: str, base: str, expected: str, adapters: dict[str, Path], tmp_path: Path
) -> None:
    import json

    folder, base_dir = adapters[adapter], FIXTURES / "hf" / base
    if command == "generate":
        proc = ckptkit("generate", base_dir, "--prompt", "hi", "--max-new-tokens", "2", "--adapter", folder)
    else:
        proc = ckptkit("merge", base_dir, folder, tmp_path / "merged")
        assert not (tmp_path / "merged").exists()
    trained_on = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    line = one_line(proc, 1)
    assert line.startswith(f"error: {folder}: ")
    assert expected.format(base=base_dir, trained_on=trained_on) in line


@pytest.mark.slow
def test_a_process_of_its_own_prints_the_same_one_line(adapters: dict[str, Path], tmp_path: Path) -> None:
    """Bad usage (exit 2) and a refused adapter (exit 1, after loading the base) as genuine
    ``python -m ckptkit`` processes: one line, as in the in-process runs above, with nothing
    printed while importing or loading."""
    args, expected = CHOICES["--to huggingface"]
    line = one_line(ckptkit_process("convert", FIXTURES / "hf/llama2", tmp_path / "o", *args), 2)
    assert expected in line
    command, adapter, base, expected = WRONG_BASE["generate, other hidden size"]
    folder, base_dir = adapters[adapter], FIXTURES / "hf" / base
    proc = ckptkit_process(command, base_dir, "--prompt", "hi", "--max-new-tokens", "2", "--adapter", folder)
    line = one_line(proc, 1)
    assert line.startswith(f"error: {folder}: ") and "it was trained on a model with hidden size 40" in line


@pytest.mark.slow
def test_resuming_with_an_adapter_of_another_base_names_the_adapter_and_the_keys(
    adapters: dict[str, Path], tmp_path: Path
) -> None:
    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import recipe_entry

    common = ["epochs=2", "max_steps_per_epoch=1", "lora.targets=[q,v]", "quiet=true"]
    recipe_entry("lora_finetune")(load_config("tiny_lora", [*common, f"checkpointer.output_dir={tmp_path / 'a'}"]))
    proc = ckptkit(
        "run", "lora_finetune", "--config", "tiny_lora", *common, f"checkpointer.output_dir={tmp_path / 'b'}",
        "resume_from_checkpoint=true", f"checkpointer.recipe_checkpoint={tmp_path / 'a' / 'epoch_0'}",
        f"checkpointer.adapter_checkpoint={adapters['olmo2']}",
    )  # fmt: skip
    line = one_line(proc, 1)
    assert line.startswith(f"error: {adapters['olmo2']}: adapter for another model: it was trained on a model with ")
    # the bundled config's paths resolve against the checkout, whatever the working directory
    assert f"hidden size 40; {FIXTURES / 'hf/llama2'} has 64; check checkpointer.adapter_checkpoint, or set " in line
    assert "checkpointer.checkpoint_dir to the model it was trained on" in line


# --- notes say whether anything needs doing ---------------------------------------------------

# "<fact>", or "<fact>; to <goal>, <action>" where action is needed: never a bare "nothing to do"
VERDICT = re.compile(r"(?!.*nothing to do$).+")


@pytest.mark.slow
def test_every_note_of_the_fixture_conversions_says_whether_action_is_needed(tmp_path: Path) -> None:
    from ckptkit.convert import ConvertOptions, convert
    from ckptkit.errors import CkptkitError

    notes: dict[str, str] = {}
    for src in sorted(p for kind in ("hf", "meta", "hf-bin", "dcp") for p in (FIXTURES / kind).iterdir()):
        config = FIXTURES / "hf" / "llama2" / "config.json" if src.parent.name == "dcp" else None
        for to in format_names():
            for dtype in (None, "bfloat16"):
                dst = tmp_path / ("o.gguf" if to == "gguf" else "o")
                try:
                    result = convert(src, dst, ConvertOptions(to, dtype=dtype, config=config, force=True))
                except CkptkitError:  # a pair ckptkit refuses (no Meta layout for qwen2, ...): no notes
                    continue
                finally:
                    if dst.is_dir():
                        shutil.rmtree(dst)
                    dst.unlink(missing_ok=True)
                notes.update({n: f"{src.relative_to(FIXTURES)} --to {to} --dtype {dtype}" for n in result.notes})
    assert len(notes) >= 4  # tokenizer specials, unused tensors not carried, no tokenizer...
    assert [f"{where}: {n}" for n, where in notes.items() if not VERDICT.fullmatch(n)] == []
    assert any("; to " in n for n in notes)  # the ones that need action say so (no tokenizer...)


def test_a_note_asks_for_action_only_when_it_is_given() -> None:
    from ckptkit.errors import note

    assert note("not cast (kept as stored): x") == "not cast (kept as stored): x"
    assert note("no tokenizer", "to have one, convert again") == "no tokenizer; to have one, convert again"


def test_every_note_is_made_by_the_function_that_adds_the_verdict() -> None:
    """Each ``notes.append(...)`` and ``on_note(...)`` in ckptkit passes ``note(...)``."""
    import ast

    unmade = []
    for path in sorted((Path(__file__).resolve().parents[2] / "ckptkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            adds_note = (isinstance(func, ast.Name) and func.id == "on_note") or (
                isinstance(func, ast.Attribute)
                and func.attr == "append"
                and ast.unparse(func.value).split(".")[-1] == "notes"
            )
            made = isinstance(node.args[0], ast.Call) and ast.unparse(node.args[0].func) == "note"
            if adds_note and not made:
                unmade.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert unmade == []
