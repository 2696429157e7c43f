"""KV-cached generation vs transformers, tokenizer loading, and the ``generate`` command."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptkit.errors import CkptkitError
from ckptkit.train.generation import generate, generate_text, sample_next
from ckptkit.train.tokenizer import HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

from train_helpers import FAMILIES, FIXTURES, fixture_config, hf_dir, hf_model, native_model


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(family: str) -> None:
    prompt = torch.randint(3, fixture_config(family).vocab_size, (1, 7), generator=torch.Generator().manual_seed(11))
    ref_model = hf_model(family)
    eos = ref_model.generation_config.eos_token_id
    ours = generate(native_model(family), prompt, 20, eos_token_id=eos)
    ref = ref_model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma"])
def test_batched_left_padded_greedy_matches_transformers(family: str) -> None:
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(3, fixture_config(family).vocab_size, (2, 8), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ours = generate(native_model(family), ids, 20, attention_mask=mask)
    ref = hf_model(family).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(ours, ref)


def _greedy_with_logits(
    family: str, ids: torch.Tensor, mask: torch.Tensor | None, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ckptkit's tokens and each step's next-token logits (B, steps, vocab), read off the model's output."""
    model = native_model(family, sliding_window=window)
    steps: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _args, out: steps.append(out[:, -1]))
    tokens = generate(model, ids, 20, attention_mask=mask)
    return tokens, torch.stack(steps, dim=1)


@pytest.mark.parametrize("padded", [False, True], ids=["one", "left-padded"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral", "gpt_oss"])
def test_sliding_window_holds_while_decoding_from_the_cache(family: str, padded: bool) -> None:
    """A window of 4 tokens, prompts of 8 (one row; or two, one left-padded by 3) and 20 new
    tokens: each cached decode step sees only the window, as in transformers' generate. Measured:
    tokens equal, step logits within 7.5e-7 (the whole context seen instead: 0.80 to 2.0 apart)."""
    ids = torch.randint(3, 384, (2, 8), generator=torch.Generator().manual_seed(12))
    real = torch.ones_like(ids)
    real[1, :3] = 0
    ids, mask = (ids.masked_fill(real == 0, 0), real) if padded else (ids[:1], None)
    tokens, logits = _greedy_with_logits(family, ids, mask, window=4)
    ref = hf_model(family, sliding_window=4).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(tokens, ref.sequences)
    assert (logits - torch.stack(ref.logits, dim=1)).abs().max().item() <= 1e-6


def test_eos_stops_and_pads_finished_rows() -> None:
    model = native_model("llama2")
    prompt = torch.tensor([[1, 50, 60], [1, 70, 80]])
    free = generate(model, prompt, 6)
    eos = int(free[0, 4])  # make row 0's second new token the "EOS"
    out = generate(model, prompt, 6, eos_token_id=eos, pad_token_id=0)
    assert out[0, 4] == eos and (out[0, 5:] == 0).all()
    if eos not in free[1, 3:].tolist():
        assert out.shape[1] == free.shape[1] and torch.equal(out[1], free[1])


def test_sampling_is_seeded_and_top_k_1_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, temperature=0.7, top_k=1), logits.argmax(-1))
    a = sample_next(logits, 1.0, 10, torch.Generator().manual_seed(3))
    b = sample_next(logits, 1.0, 10, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    top10 = logits.topk(10, dim=-1).indices
    assert all(a[i] in top10[i] for i in range(4))


@pytest.mark.parametrize("family", ["llama2", "llama3", "qwen2", "gemma"])
def test_tokenizer_matches_transformers(family: str) -> None:
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog. Hello world!"
    ours = load_tokenizer(hf_dir(family))
    ref = AutoTokenizer.from_pretrained(hf_dir(family))
    ids = ours.encode(text)
    assert isinstance(ours, HFTokenizer)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ref.eos_token_id in ours.eos_ids


def test_sentencepiece_tokenizer_from_meta_dir() -> None:
    meta = FIXTURES / "meta" / "llama2"
    if not (meta / "tokenizer.model").is_file():
        pytest.skip("meta fixture missing")
    from transformers import AutoTokenizer

    tok = load_tokenizer(meta)
    assert isinstance(tok, SentencePieceTokenizer)
    text = "Hello world, this is ckptkit."
    assert tok.encode(text) == AutoTokenizer.from_pretrained(hf_dir("llama2"))(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_ids == [2]


@pytest.mark.parametrize("family", ["llama3", "llama3_1"])
def test_tiktoken_tokenizer_model_matches_tokenizer_json(family: str, tmp_path: Path) -> None:
    """Meta Llama 3 ships only a tiktoken-format tokenizer.model; it must encode like tokenizer.json."""
    meta = FIXTURES / "meta" / family
    if not (meta / "tokenizer.model").is_file():
        pytest.skip("meta fixture missing")
    only_model = tmp_path / "original"
    only_model.mkdir()
    shutil.copy(meta / "tokenizer.model", only_model / "tokenizer.model")
    tok, ref = load_tokenizer(only_model), HFTokenizer(FIXTURES / "hf" / family / "tokenizer.json")
    assert isinstance(tok, TiktokenTokenizer)
    text = (FIXTURES / "corpus.txt").read_text()
    for piece in [*text.splitlines()[:40], text, "  tabs\tand\n\nnewlines 12345 émoji 😀"]:
        assert tok.encode(piece) == ref.encode(piece)
    assert tok.decode(tok.encode(text)) == text


def _weights_only(family: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"{family}-no-tokenizer"
    dst.mkdir()
    for f in hf_dir(family).iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    return dst


def test_missing_tokenizer_is_one_line_cli_error(tmp_path: Path) -> None:
    from ckptkit.cli import app

    ckpt = _weights_only("llama3", tmp_path)
    with pytest.raises(CkptkitError, match="no tokenizer found"):
        load_tokenizer(ckpt)
    result = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", "hi"])
    assert result.exit_code == 1
    message = result.stderr.strip() if hasattr(result, "stderr") else result.output.strip()
    assert len(message.splitlines()) == 1
    assert "no tokenizer found" in message and "Traceback" not in result.output


def test_generate_command_greedy_matches_library(capsys: pytest.CaptureFixture[str]) -> None:
    from ckptkit.cli import app

    ckpt = hf_dir("llama2")
    expected = generate_text(str(ckpt), "The quick brown", max_new_tokens=8)
    result = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", "The quick brown", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"
    assert expected.startswith("The quick brown")
    sampled = CliRunner().invoke(
        app,
        ["generate", str(ckpt), "--prompt", "The", "--max-new-tokens", "5", "--temperature", "0.9", "--top-k", "20"],
    )
    assert sampled.exit_code == 0, sampled.output


def _short_context(tmp_path: Path, context: int) -> Path:
    """The llama2 fixture with ``max_position_embeddings`` lowered (the weights do not depend on it)."""
    import json

    dst = tmp_path / "short"
    shutil.copytree(hf_dir("llama2"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = context
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_generate_is_capped_at_the_context_and_streams(tmp_path: Path) -> None:
    from ckptkit.cli import app

    ckpt = _short_context(tmp_path, 12)
    prompt_len = len(load_tokenizer(ckpt).encode("The quick brown"))
    args = ["generate", str(ckpt), "--prompt", "The quick brown", "--max-new-tokens", "100000"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    room = 12 - prompt_len
    assert result.stderr.strip() == (
        f"note: --max-new-tokens 100000 capped at {room}: the prompt ({prompt_len} tokens) "
        "plus the completion fill the model's context of 12 tokens"
    )
    pieces: list[str] = []
    text = generate_text(str(ckpt), "The quick brown", max_new_tokens=room, on_text=pieces.append)
    assert result.stdout == text + "\n"  # nothing more than the context holds
    assert "".join(pieces) == text and pieces[0] == "The quick " and len(pieces) > 1  # the prompt comes first
    too_long = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", "a b c d e f g h i j k l m n"])
    assert too_long.exit_code == 1
    assert "the model's context is 12; shorten it" in too_long.stderr and len(too_long.stderr.splitlines()) == 1


def test_pickled_adapter_is_one_line(tmp_path: Path) -> None:
    import json

    from ckptkit.cli import app

    torch.save({"lora": torch.nn.Linear(2, 2)}, tmp_path / "adapter_model.bin")  # a pickled module, not tensors
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": ["q"]}))
    result = CliRunner().invoke(app, ["generate", str(hf_dir("llama2")), "--prompt", "hi", "--adapter", str(tmp_path)])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'adapter_model.bin'}: not a plain file of tensors (UnpicklingError)" in result.stderr


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2_CHAT = "{% for m in messages %}{{ bos_token }}[INST] {{ m['content'] | trim }} [/INST]{% endfor %}"


@pytest.mark.parametrize(("family", "template"), [("qwen2", CHATML), ("llama2", LLAMA2_CHAT)])
def test_chat_prompt_is_transformers_apply_chat_template(family: str, template: str, tmp_path: Path) -> None:
    import json

    from transformers import AutoTokenizer

    from ckptkit.cli import app
    from ckptkit.train.generation import chat_prompt_ids

    ckpt = tmp_path / family
    shutil.copytree(hf_dir(family), ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    messages = [{"role": "user", "content": "Name a cold place. "}]
    theirs = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(messages, add_generation_prompt=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    tokenizer = load_tokenizer(ckpt)
    ours = chat_prompt_ids(str(ckpt), "Name a cold place. ", tokenizer)
    assert ours == list(theirs)  # the template's BOS once, not twice
    # --chat prints the reply to that prompt, and only the reply
    result = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", "Name a cold place. ", "--chat",
                                      "--max-new-tokens", "5"])  # fmt: skip
    assert result.exit_code == 0, result.output
    reply = generate(native_model(family), torch.tensor([ours]), 5, eos_token_id=tokenizer.eos_ids)[0, len(ours) :]
    assert result.stdout == tokenizer.decode(reply.tolist()) + "\n"


def test_chat_without_a_template_says_which_file_lacks_it_and_what_to_do() -> None:
    from ckptkit.cli import app

    result = CliRunner().invoke(app, ["generate", str(hf_dir("llama2")), "--prompt", "hi", "--chat"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"error: {hf_dir('llama2') / 'tokenizer_config.json'} has no chat template " in result.stderr
    assert "drop --chat to continue PROMPT as plain text, or save the model's chat template as " in result.stderr
    assert "dataset.chat_template" not in result.stderr  # a training key, not for generate


def test_an_empty_completion_says_why(tmp_path: Path) -> None:
    """A model whose first new token is end-of-sequence prints the prompt alone and a note
    saying so (here: the llama2 fixture with its EOS set to the token transformers picks first)."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from ckptkit.cli import app

    prompt = "The quick"
    ids = AutoTokenizer.from_pretrained(hf_dir("llama2"))(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        first = int(hf_model("llama2")(ids).logits[0, -1].argmax())
    ckpt = tmp_path / "llama2"
    shutil.copytree(hf_dir("llama2"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    get_peft_model(hf_model("llama2"), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    result = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", prompt, "--adapter", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert result.stdout == prompt + "\n"
    assert result.stderr.strip() == (
        "note: the model produced end-of-sequence as its first token: the completion is empty; "
        "to get text, change the prompt, sample with --temperature, or use --chat with a chat model"
    )
