"""Training data: alpaca-style instructions and plain-text completion, with padding collate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, Strict

from ckptkit.errors import CkptkitError
from ckptkit.train.config import Bool, Section, Text
from ckptkit.train.tokenizer import Tokenizer

IGNORE_INDEX = -100
PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
INPUT_BLOCK = "### Input:\n{input}\n\n"
DATASET_DIR = Path(__file__).parent / "datasets"


class DatasetConfig(Section):
    """The ``dataset:`` section of every recipe config."""

    components: ClassVar[dict[str, dict[str, Any]]] = {
        "torchtune.datasets.instruct_dataset": {"type": "instruct"},
        "torchtune.datasets.alpaca_dataset": {"type": "instruct"},
        "torchtune.datasets.text_completion_dataset": {"type": "text"},
    }
    type: Literal["instruct", "text"] = "instruct"
    source: Text = "tiny_alpaca"
    max_seq_len: Annotated[int, Strict(), Field(ge=2)] = 512
    train_on_input: Bool = False


def resolve_data_path(source: str) -> Path:
    """A data file path, or the name of a bundled dataset (``tiny_alpaca``)."""
    path = Path(source)
    if path.is_file():
        return path
    if path.is_absolute() or len(path.parts) != 1:
        raise CkptkitError(f"dataset.source: {source}: no such file")
    for candidate in DATASET_DIR.glob(f"{source}.*"):
        return candidate
    raise CkptkitError(f"dataset.source: {source}: no such file or bundled dataset")


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs from a JSONL file or a JSON list."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise CkptkitError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(rows, list):
            raise CkptkitError(f"{path}: expected a JSON list of objects")
        return [(i + 1, r) for i, r in enumerate(rows)]  # positions in the list for .json
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise CkptkitError(f"{path}:{n}: invalid JSON: {e.msg}") from None
    return out


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s ids without the BOS token ``encode`` adds."""
    bos = tokenizer.encode("")
    ids = tokenizer.encode(text)
    return ids[len(bos) :] if bos and ids[: len(bos)] == bos else ids


class InstructDataset:
    """Alpaca rows (``instruction``, optional ``input``, ``output``); loss on the response only."""

    def __init__(self, path: Path, tokenizer: Tokenizer, max_seq_len: int, train_on_input: bool = False):
        self.samples: list[tuple[list[int], list[int]]] = []
        for line, row in read_rows(path):
            where = f"{path}:{line}" if path.suffix != ".json" else f"{path}: item {line}"
            if not isinstance(row, dict):
                raise CkptkitError(f"{where}: expected an object with instruction/input/output")
            missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
            if missing or not isinstance(row.get("input", ""), str):
                what = ", ".join(missing) or "input"
                raise CkptkitError(f"{where}: missing or non-string field(s): {what}")
            inp = row.get("input") or ""
            prompt = PROMPT.format(
                instruction=row["instruction"], input_block=INPUT_BLOCK.format(input=inp) if inp else ""
            )
            p_ids = tokenizer.encode(prompt)  # with BOS when the tokenizer has one
            r_ids = [*encode_plain(tokenizer, row["output"]), *tokenizer.eos_ids[:1]]
            ids = (p_ids + r_ids)[:max_seq_len]
            labels = (list(p_ids) if train_on_input else [IGNORE_INDEX] * len(p_ids)) + r_ids
            self.samples.append((ids, labels[:max_seq_len]))
        if not self.samples:
            raise CkptkitError(f"{path}: no rows")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.samples[i]


class TextCompletionDataset:
    """A plain-text file tokenised whole and cut into ``max_seq_len`` chunks; loss everywhere."""

    def __init__(self, path: Path, tokenizer: Tokenizer, max_seq_len: int):
        ids: list[int] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                ids += [*tokenizer.encode(line), *tokenizer.eos_ids[:1]]
        self.samples = [ids[i : i + max_seq_len] for i in range(0, len(ids) - 1, max_seq_len)]
        self.samples = [(s, list(s)) for s in self.samples if len(s) > 1]
        if not self.samples:
            raise CkptkitError(f"{path}: no text")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.samples[i]


def build_dataset(cfg: dict[str, Any], tokenizer: Tokenizer) -> InstructDataset | TextCompletionDataset:
    kind = cfg.get("type", "instruct")
    path = resolve_data_path(str(cfg.get("source", "tiny_alpaca")))
    max_len = int(cfg.get("max_seq_len", 512))
    if kind == "instruct":
        return InstructDataset(path, tokenizer, max_len, bool(cfg.get("train_on_input", False)))
    if kind == "text":
        return TextCompletionDataset(path, tokenizer, max_len)
    raise CkptkitError(f"dataset.type must be instruct or text, not {kind!r}")


def check_trainable(dataset: InstructDataset | TextCompletionDataset, max_seq_len: int) -> None:
    """Refuse a dataset where no sample keeps a token to train on (all cut off by ``max_seq_len``)."""
    if not any(label != IGNORE_INDEX for _, labels in dataset.samples for label in labels[1:]):
        raise CkptkitError(
            f"dataset.max_seq_len={max_seq_len} leaves no sample a token to train on "
            "(prompts fill it, responses are cut off); raise dataset.max_seq_len"
        )


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; labels already shifted for next-token prediction."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        # position t predicts token t+1
        labels[row, : len(lab) - 1] = torch.tensor(lab[1:])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The sample indices of each batch of one epoch: a seeded shuffle, last partial batch dropped."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
