"""Training data: instruct (alpaca or a custom template), chat and plain-text datasets, tokenised.

Every sample is tokenised as ONE text (prompt + response, or a whole rendered
conversation), so the ids are exactly the tokenizer's encoding of what the model will
read; the loss mask is then cut at the token where the response starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, Strict, model_validator

from ckptkit.errors import CkptkitError
from ckptkit.train.config import Bool, Section, Text
from ckptkit.train.data_sources import Row, hold_out, load_rows, read_utf8, resolve_source
from ckptkit.train.packing import document_inputs, pack
from ckptkit.train.samples import IGNORE_INDEX, Sample
from ckptkit.train.tokenizer import HFTokenizer, Tokenizer

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
ALPACA_INPUT_BLOCK = "### Input:\n{input}\n\n"
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class DatasetConfig(Section):
    """The ``dataset:`` section of every recipe config."""

    components: ClassVar[dict[str, dict[str, Any]]] = {
        "torchtune.datasets.instruct_dataset": {"type": "instruct"},
        "torchtune.datasets.alpaca_dataset": {"type": "instruct"},
        "torchtune.datasets.chat_dataset": {"type": "chat"},
        "torchtune.datasets.text_completion_dataset": {"type": "text"},
    }
    type: Literal["instruct", "chat", "text"] = "instruct"
    source: Text = "tiny_alpaca"
    split: Text = "train"
    column_map: dict[Text, Text] = Field(default_factory=dict)
    template: Text = "alpaca"
    chat_template: Text | None = None
    max_seq_len: Annotated[int, Strict(), Field(ge=2)] = 512
    train_on_input: Bool = False
    packed: Bool = False
    validation_split: Text | None = None
    validation_fraction: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        if self.validation_split is not None and self.validation_fraction is not None:
            raise ValueError("set validation_split or validation_fraction, not both")
        if self.type != "instruct" and self.template != "alpaca":
            raise ValueError(f"template applies to type instruct, not {self.type}")
        return self


class TokenizedDataset:
    """A list of samples; ``len`` and indexing as a map-style dataset."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def build_datasets(
    conf: DatasetConfig, tokenizer: Tokenizer, tokenizer_dir: Path | None = None, seed: int = 0
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """(training set, validation set or None) as the validated ``dataset:`` section says."""
    tokenize = _tokenizer_for(conf, tokenizer, tokenizer_dir)
    where = resolve_source(conf.source)
    if conf.type == "text" and isinstance(where, Path) and where.suffix == ".txt":
        rows: list[Row] = [(f"{where}:{n}", {"text": line}) for n, line in enumerate(_lines(where), start=1)]
    else:
        rows = load_rows(conf.source, conf.split, conf.column_map)
    val_rows = None
    if conf.validation_split is not None:
        val_rows = load_rows(conf.source, conf.validation_split, conf.column_map)
    elif conf.validation_fraction is not None:
        rows, val_rows = hold_out(rows, conf.validation_fraction, seed)

    def make(rows: list[Row]) -> TokenizedDataset:
        if not rows:
            raise CkptkitError(f"dataset.source: {conf.source}: no rows")
        samples = _text_samples(rows, tokenizer, conf.max_seq_len) if conf.type == "text" else tokenize(rows)
        samples = [s for s in samples if any(label != IGNORE_INDEX for label in s.labels[1:])]
        if not samples:
            raise CkptkitError(
                f"dataset.max_seq_len={conf.max_seq_len} leaves no sample a token to train on "
                "(prompts fill it, responses are cut off); raise dataset.max_seq_len"
            )
        return TokenizedDataset(pack(samples, conf.max_seq_len) if conf.packed else samples)

    return make(rows), (make(val_rows) if val_rows is not None else None)


def build_dataset(conf: DatasetConfig, tokenizer: Tokenizer, tokenizer_dir: Path | None = None) -> TokenizedDataset:
    """The training set alone (see ``build_datasets``)."""
    return build_datasets(conf, tokenizer, tokenizer_dir)[0]


def encode_segments(tokenizer: Tokenizer, segments: list[tuple[str, bool]], add_bos: bool = True) -> Sample:
    """Tokenise the concatenated texts as one; labels only on tokens of segments marked trainable.

    A token spanning a segment boundary counts toward the later segment.
    """
    text = "".join(t for t, _ in segments)
    ids = tokenizer.encode(text, add_bos=add_bos)
    labels, start, chars = [], 0, 0
    for i, (seg, trainable) in enumerate(segments):
        chars += len(seg)
        end = len(ids) if i == len(segments) - 1 else _common_prefix(tokenizer.encode(text[:chars], add_bos), ids)
        end = max(end, start)
        labels += ids[start:end] if trainable else [IGNORE_INDEX] * (end - start)
        start = end
    return Sample(ids, labels)


def instruct_prompt(row: dict[str, Any], template: str) -> str:
    """The prompt for an instruct row: alpaca's, or ``template`` formatted with the row's fields."""
    if template == "alpaca":
        inp = row.get("input") or ""
        block = ALPACA_INPUT_BLOCK.format(input=inp) if inp else ""
        return ALPACA_PROMPT.format(instruction=row["instruction"], input_block=block)
    return template.format(**row)


def chat_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """OpenAI ``messages`` (role/content) or ShareGPT ``conversations`` (from/value), as role/content."""
    if isinstance(row.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None) for m in row["messages"]]
    elif isinstance(row.get("conversations"), list):
        turns = [
            (SHAREGPT_ROLES.get(m.get("from", "")), m.get("value")) if isinstance(m, dict) else (None, None)
            for m in row["conversations"]
        ]
    else:
        raise CkptkitError(f"{where}: expected a messages (role/content) or conversations (from/value) list")
    for n, (role, content) in enumerate(turns, start=1):
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise CkptkitError(f"{where}: message {n}: needs a role system/user/assistant and string content")
    if not any(role == "assistant" for role, _ in turns):
        raise CkptkitError(f"{where}: the conversation has no assistant message")
    return [{"role": str(role), "content": str(content)} for role, content in turns]


def _tokenizer_for(conf: DatasetConfig, tokenizer: Tokenizer, tokenizer_dir: Path | None) -> Any:
    """rows -> samples for ``conf.type`` (instruct or chat)."""
    if conf.type == "chat":
        from ckptkit.train.chat_template import load_chat_template

        if not isinstance(tokenizer, HFTokenizer):
            raise CkptkitError("dataset.type chat needs a tokenizer.json (the rendered text holds special tokens)")
        if tokenizer_dir is None and conf.chat_template is None:
            raise CkptkitError("dataset.type chat needs the tokenizer folder or dataset.chat_template")
        chat = load_chat_template(tokenizer_dir or Path("."), conf.chat_template)

        def chat_sample(where: str, row: dict[str, Any]) -> Sample:
            messages = chat_messages(row, where)
            segments, done = [], ""
            for k, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = chat.render(messages[:k], add_generation_prompt=True)
                through = chat.render(messages[: k + 1])
                if not before.startswith(done) or not through.startswith(before):
                    raise CkptkitError(f"{chat.origin}: the chat template does not render conversations prefix by "
                                       "prefix, so assistant turns cannot be located for the loss mask")  # fmt: skip
                segments += [(before[len(done) :], conf.train_on_input), (through[len(before) :], True)]
                done = through
            full = chat.render(messages)
            if not full.startswith(done):
                raise CkptkitError(f"{chat.origin}: the chat template renders the whole conversation differently")
            segments.append((full[len(done) :], conf.train_on_input))
            return encode_segments(tokenizer, [s for s in segments if s[0]], add_bos=False)

        make_sample = chat_sample
    else:

        def instruct_sample(where: str, row: dict[str, Any]) -> Sample:
            if conf.template == "alpaca":
                needed = ("instruction", "output")
                missing = [k for k in needed if not isinstance(row.get(k), str)]
                if not missing and not isinstance(row.get("input") or "", str):
                    missing = ["input"]
            else:
                missing = [] if isinstance(row.get("output"), str) else ["output"]
            if missing:
                raise CkptkitError(f"{where}: missing or non-string field(s): {', '.join(missing)}")
            try:
                prompt = instruct_prompt(row, conf.template)
            except (KeyError, IndexError, ValueError) as exc:
                raise CkptkitError(f"{where}: dataset.template {conf.template!r}: {exc!r} not in the row") from None
            sample = encode_segments(tokenizer, [(prompt, conf.train_on_input), (row["output"], True)])
            eos = tokenizer.eos_ids[:1]
            return Sample(sample.ids + eos, sample.labels + eos)

        make_sample = instruct_sample

    def samples(rows: list[Row]) -> list[Sample]:
        out = []
        for where, row in rows:
            if not isinstance(row, dict):
                raise CkptkitError(f"{where}: expected an object")
            s = make_sample(where, row)
            out.append(Sample(s.ids[: conf.max_seq_len], s.labels[: conf.max_seq_len]))
        return out

    return samples


def _text_samples(rows: list[Row], tokenizer: Tokenizer, max_seq_len: int) -> list[Sample]:
    """Every row's ``text`` (+ EOS) concatenated and cut into ``max_seq_len`` chunks; loss everywhere."""
    ids: list[int] = []
    for where, row in rows:
        text = row.get("text")
        if not isinstance(text, str):
            raise CkptkitError(f"{where}: missing or non-string field(s): text")
        if text.strip():
            ids += [*tokenizer.encode(text), *tokenizer.eos_ids[:1]]
    chunks = [ids[i : i + max_seq_len] for i in range(0, len(ids) - 1, max_seq_len)]
    return [Sample(c, list(c)) for c in chunks if len(c) > 1]


def _lines(path: Path) -> list[str]:
    return read_utf8(path).splitlines()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def collate(batch: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; labels shifted so position t predicts token t+1.

    Packed samples also get ``position_ids`` restarting at each document and a block-diagonal
    causal ``attention_mask`` (B, 1, T, T), so no document attends to another.
    """
    width = max(len(s.ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        input_ids[row, : len(s.ids)] = torch.tensor(s.ids)
        mask[row, : len(s.ids)] = 1
        labels[row, : len(s.labels) - 1] = torch.tensor(s.labels[1:])
    out = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if any(s.lengths for s in batch):
        out.update(document_inputs([s.lengths or [len(s.ids)] for s in batch], width))
    return out


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The sample indices of each batch of one epoch: a seeded shuffle, last partial batch dropped."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
