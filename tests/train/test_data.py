"""Training data: whole-text tokenisation, chat templates vs transformers, file formats, packing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.train.chat_template import load_chat_template
from ckptkit.train.config import parse_config
from ckptkit.train.data import IGNORE_INDEX, DatasetConfig, build_dataset, build_datasets, collate
from ckptkit.train.data_sources import DATASET_DIR, resolve_source
from ckptkit.train.schema import FullFinetuneConfig
from ckptkit.train.tokenizer import load_tokenizer

from conftest import FIXTURES

ALPACA = [json.loads(line) for line in (DATASET_DIR / "tiny_alpaca.jsonl").read_text().splitlines()]


def dataset(keys: dict) -> DatasetConfig:
    """A ``dataset:`` section as a recipe config's validation makes it."""
    return parse_config({"checkpointer": {"checkpoint_dir": "in", "output_dir": "out"}, "dataset": keys},
                        FullFinetuneConfig).dataset  # fmt: skip


PROMPT = "### Instruction:\n{instruction}\n\n{block}### Response:\n"

# Templates written in the style of the public model cards: Llama 3 (with generation
# markers, so transformers can compute the assistant mask), ChatML (Qwen 2) and Mistral.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the opposite of hot?"}, {"role": "assistant", "content": "cold"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Opposite of big?"},
        {"role": "assistant", "content": "small"},
        {"role": "user", "content": "And of up?"},
        {"role": "assistant", "content": "down  "},
    ],
]


def hf_tokenizer(family: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / "hf" / family)


def chat_tokenizer_dir(tmp: Path, family: str, template: str, specials: list[str]) -> tuple[Path, object]:
    """The fixture's tokenizer with ``specials`` added and ``template`` set, saved by transformers."""
    tok = hf_tokenizer(family)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.save_pretrained(tmp)
    return tmp, tok


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_instruct_sample_is_the_whole_text_encoding(family: str) -> None:
    """Prompt + response tokenised as one text: no spurious "▁" before the response."""
    tok = hf_tokenizer(family)
    data = build_dataset(
        dataset({"source": "tiny_alpaca", "max_seq_len": 512}), load_tokenizer(FIXTURES / "hf" / family)
    )
    for row, sample in zip(ALPACA, data.samples, strict=True):
        block = f"### Input:\n{row['input']}\n\n" if row.get("input") else ""
        prompt = PROMPT.format(instruction=row["instruction"], block=block)
        expected = tok(prompt + row["output"]).input_ids + [tok.eos_token_id]
        assert sample.ids == expected
        trained = [t for t in sample.labels if t != IGNORE_INDEX]
        assert tok.decode(trained, skip_special_tokens=True) == row["output"]
        assert sample.labels[: len(sample.ids) - len(trained)] == [IGNORE_INDEX] * (len(sample.ids) - len(trained))


def test_sentencepiece_model_sample_is_the_whole_text_encoding(tmp_path: Path) -> None:
    import sentencepiece

    shutil.copy(FIXTURES / "hf" / "llama2" / "tokenizer.model", tmp_path)  # no tokenizer.json: sentencepiece path
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    data = build_dataset(dataset({"source": "tiny_alpaca"}), load_tokenizer(tmp_path))
    row, sample = ALPACA[0], data.samples[0]
    text = PROMPT.format(instruction=row["instruction"], block=f"### Input:\n{row['input']}\n\n") + row["output"]
    assert sample.ids == [sp.bos_id(), *sp.encode(text), sp.eos_id()]
    assert sp.decode([t for t in sample.labels if t != IGNORE_INDEX]) == row["output"]


@pytest.mark.parametrize(
    ("family", "template", "specials"),
    [
        ("llama3", LLAMA3, []),
        ("qwen2", CHATML, ["<|im_start|>", "<|im_end|>"]),
        ("llama2", MISTRAL, []),
    ],
)
def test_chat_rendering_equals_apply_chat_template(family: str, template: str, specials: list[str], tmp_path: Path):
    folder, tok = chat_tokenizer_dir(tmp_path, family, template, specials)
    ours = load_chat_template(folder)
    for messages in CONVERSATIONS:
        if template is MISTRAL and messages[0]["role"] == "system":
            with pytest.raises(CkptkitError, match="roles must alternate"):
                ours.render(messages)
            continue
        assert ours.render(messages) == tok.apply_chat_template(messages, tokenize=False)
        head = messages[:-1]
        assert ours.render(head, add_generation_prompt=True) == tok.apply_chat_template(
            head, tokenize=False, add_generation_prompt=True
        )
    rows = [{"messages": m} for m in CONVERSATIONS if template is not MISTRAL or m[0]["role"] != "system"]
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_dataset(dataset({"type": "chat", "source": str(data_file)}), load_tokenizer(folder), folder)
    for row, sample in zip(rows, data.samples, strict=True):
        reference = tok.apply_chat_template(row["messages"], return_dict=True, return_assistant_tokens_mask=True)
        assert sample.ids == reference["input_ids"]
        trained = [t for t in sample.labels if t != IGNORE_INDEX]
        if template is LLAMA3:  # generation markers: transformers' own assistant mask
            mask = reference["assistant_masks"]
            assert sample.labels == [t if m else IGNORE_INDEX for t, m in zip(sample.ids, mask, strict=True)]
        end = {CHATML: "<|im_end|>\n", MISTRAL: tok.eos_token}.get(template, "<|eot_id|>")
        replies = [m["content"].strip() if template is LLAMA3 else m["content"] for m in row["messages"]]
        expected = "".join(c + end for c, m in zip(replies, row["messages"], strict=True) if m["role"] == "assistant")
        assert tok.decode(trained) == expected


def test_sharegpt_equals_openai_messages_and_template_sources(tmp_path: Path) -> None:
    folder, _ = chat_tokenizer_dir(tmp_path / "tok", "llama3", LLAMA3, [])
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]} for c in CONVERSATIONS]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    (tmp_path / "b.json").write_text(json.dumps(share))
    tokenizer = load_tokenizer(folder)
    a = build_dataset(dataset({"type": "chat", "source": str(tmp_path / "a.jsonl")}), tokenizer, folder)
    b = build_dataset(dataset({"type": "chat", "source": str(tmp_path / "b.json")}), tokenizer, folder)
    assert a.samples == b.samples
    # the template embedded in tokenizer_config.json, as older transformers saved it
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3}))
    (folder / "chat_template.jinja").unlink()
    assert (
        build_dataset(dataset({"type": "chat", "source": str(tmp_path / "a.jsonl")}), tokenizer, folder).samples
        == a.samples
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CkptkitError, match="has no chat template"):
        build_dataset(dataset({"type": "chat", "source": str(tmp_path / "a.jsonl")}), tokenizer, folder)
    (tmp_path / "t.jinja").write_text(LLAMA3)
    cfg = {"type": "chat", "source": str(tmp_path / "a.jsonl"), "chat_template": str(tmp_path / "t.jinja")}
    assert build_dataset(dataset(cfg), tokenizer, folder).samples == a.samples


def test_every_file_format_gives_the_same_samples(tmp_path: Path) -> None:
    """parquet, csv, arrow (save_to_disk) and JSON through `datasets`; column_map, split slices, custom template."""
    import datasets

    rows = [{"q": r["instruction"] + " " + r["input"], "a": r["output"]} for r in ALPACA]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(tmp_path / "d.parquet")
    table.to_csv(tmp_path / "d.csv", index=False)
    table.to_json(tmp_path / "d.jsonl")
    datasets.DatasetDict({"train": table.select(range(40)), "test": table.select(range(40, 48))}).save_to_disk(
        tmp_path / "saved"
    )
    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama3")
    common = {"column_map": {"output": "a"}, "template": "Q: {q}\nA: "}
    samples = [
        build_dataset(dataset({"source": str(tmp_path / name), **common}), tokenizer).samples
        for name in ("d.parquet", "d.csv", "d.jsonl")
    ]
    assert samples[0] == samples[1] == samples[2] and len(samples[0]) == 48
    saved = dataset({"source": str(tmp_path / "saved"), "validation_split": "test", **common})
    train, val = build_datasets(saved, tokenizer)
    assert train.samples == samples[0][:40] and val is not None and val.samples == samples[0][40:]
    head = build_dataset(dataset({"source": str(tmp_path / "d.parquet"), "split": "train[:5]", **common}), tokenizer)
    assert head.samples == samples[0][:5]
    expected = tokenizer.encode(f"Q: {rows[0]['q']}\nA: {rows[0]['a']}") + tokenizer.eos_ids[:1]
    assert samples[0][0].ids == expected
    with pytest.raises(CkptkitError, match=r"d.parquet \[train\]: row 1: dataset.column_map: no column 'answer'"):
        build_dataset(dataset({"source": str(tmp_path / "d.parquet"), "column_map": {"output": "answer"}}), tokenizer)
    with pytest.raises(CkptkitError, match=r"dataset.template 'Q: \{question\}'"):
        build_dataset(
            dataset({"source": str(tmp_path / "d.parquet"), **common, "template": "Q: {question}"}), tokenizer
        )


def test_a_bundled_dataset_is_read_without_datasets_as_datasets_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny_alpaca's rows, read without importing ``datasets`` (every training process saves
    its seconds), are the rows ``datasets.load_dataset("json")`` gives, labelled by line."""
    import datasets

    from ckptkit.train import data_sources

    path = DATASET_DIR / "tiny_alpaca.jsonl"
    theirs = [dict(r) for r in datasets.load_dataset("json", data_files=str(path), split="train")]

    def refused(*args: object) -> None:
        raise AssertionError("datasets was asked")

    monkeypatch.setattr(data_sources, "_rows_via_datasets", refused)
    rows = data_sources.load_rows("tiny_alpaca", "train")
    assert [r for _, r in rows] == theirs and len(theirs) == 48
    assert [label for label, _ in rows] == [f"{path}:{n}" for n in range(1, 49)]


def test_validation_fraction_holds_rows_out() -> None:
    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama3")
    full = build_dataset(dataset({"source": "tiny_alpaca"}), tokenizer).samples
    train, val = build_datasets(dataset({"source": "tiny_alpaca", "validation_fraction": 0.25}), tokenizer, seed=3)
    assert val is not None and (len(train), len(val)) == (36, 12)
    assert sorted(map(str, train.samples + val.samples)) == sorted(map(str, full))
    again = build_datasets(dataset({"source": "tiny_alpaca", "validation_fraction": 0.25}), tokenizer, seed=3)[1]
    assert again is not None and again.samples == val.samples  # seeded


def test_data_config_errors_are_one_line() -> None:
    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama3")
    cases = {
        "config key dataset.max_seq_len: input should be greater than or equal to 2": {"max_seq_len": 1},
        "config: unknown key dataset.packd; did you mean dataset.packed?": {"packd": True},
        "config key dataset.validation_fraction: input should be less than 1": {"validation_fraction": 1.5},
        "set validation_split or validation_fraction, not both": {"validation_split": "a", "validation_fraction": 0.1},
        "config key dataset.source: /nope/x.jsonl: no such file": {"source": "/nope/x.jsonl"},
        "dataset.max_seq_len=4 leaves no sample a token to train on": {"max_seq_len": 4},  # prompts fill it
    }
    for message, cfg in cases.items():
        with pytest.raises(CkptkitError, match=re.escape(message)):
            build_dataset(dataset(cfg), tokenizer)
    assert resolve_source("tatsu-lab/alpaca") == "tatsu-lab/alpaca"  # not local: a Hub name for load_dataset


def test_packed_rows_compute_what_their_documents_compute() -> None:
    from train_helpers import native_model

    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama2")
    plain = build_dataset(dataset({"source": "tiny_alpaca"}), tokenizer).samples[:6]
    packed = build_dataset(dataset({"source": "tiny_alpaca", "packed": True, "max_seq_len": 256}), tokenizer).samples
    assert all(len(p.ids) <= 256 for p in packed) and sum(len(p.lengths) for p in packed[:2]) >= 6
    model = native_model("llama2")
    batch = collate(packed[:2], pad_id=0)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["document_mask"], position_ids=batch["position_ids"])
        docs = [(r, sum(p.lengths[:d]), n) for r, p in enumerate(packed[:2]) for d, n in enumerate(p.lengths)]
        for (row, start, n), sample in zip(docs, plain, strict=False):
            alone = model(torch.tensor([sample.ids]))[0]
            assert sample.ids == packed[row].ids[start : start + n]
            assert (logits[row, start : start + n] - alone).abs().max() < 1e-5
            # no document learns to predict the next one's first token
            assert start == 0 or batch["labels"][row, start - 1] == IGNORE_INDEX


@pytest.mark.parametrize(("name", "keys"), [("d.jsonl", {}), ("d.txt", {"type": "text"}), ("d.csv", {})])
def test_a_dataset_that_is_not_utf8_is_named_with_line_and_offset(tmp_path: Path, name: str, keys: dict) -> None:
    """Latin-1 text (``é`` as the one byte 0xe9) on the third line: that byte's file, line, offset."""
    good = {".jsonl": '{"instruction": "a", "output": "b"}', ".txt": "plain text", ".csv": "instruction,output"}
    first = good[Path(name).suffix]
    second = {".jsonl": '{"instruction": "c", "output": "d"}', ".txt": "more", ".csv": "c,d"}[Path(name).suffix]
    bad = "caf\u00e9".encode("latin-1")
    data = f"{first}\n{second}\n".encode() + bad + b"\n"
    (tmp_path / name).write_bytes(data)
    offset = len(first) + 1 + len(second) + 1 + 3  # c, a, f, then the 0xe9
    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama3")
    message = f"{tmp_path / name}:3: not UTF-8 text (byte 0xe9 at offset {offset}); save it as UTF-8"
    with pytest.raises(CkptkitError, match=f"^{re.escape(message)}$"):
        build_dataset(dataset({"source": str(tmp_path / name), **keys}), tokenizer)
