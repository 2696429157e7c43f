"""Tokenizer found next to a checkpoint: HF ``tokenizer.json``, or a sentencepiece or tiktoken
``tokenizer.model``; for a GGUF, the one rebuilt from its metadata."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from ckptkit.errors import CkptkitError
from ckptkit.formats import source_file_format
from ckptkit.formats.base import read_json
from ckptkit.tokenization import tiktoken_bpe


class Tokenizer(Protocol):
    """What generation needs: text <-> ids, plus the end-of-sequence ids."""

    eos_ids: list[int]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Ids for ``text``, with the BOS token when the tokenizer adds one and ``add_bos``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text for ``ids``, special tokens skipped."""
        ...


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library (its post-processor adds BOS)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise CkptkitError(f"cannot read tokenizer {path}: {str(exc).splitlines()[0]}") from exc
        self.eos_ids: list[int] = []
        tok_cfg = path.parent / "tokenizer_config.json"
        if tok_cfg.is_file():  # transformers' record of the EOS token
            eos = read_json(tok_cfg)[1].get("eos_token")  # one line when it is not a JSON object
            eos = eos.get("content") if isinstance(eos, dict) else eos
            eos_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None
            self.eos_ids = [eos_id] if eos_id is not None else []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class SentencePieceTokenizer:
    """A sentencepiece ``tokenizer.model`` (Llama 2, Mistral, Gemma); BOS prepended when defined."""

    def __init__(self, path: Path) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise CkptkitError(f"{path} is neither a sentencepiece nor a tiktoken tokenizer model") from exc
        eos = self._sp.eos_id()
        self.eos_ids: list[int] = [eos] if eos >= 0 else []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        bos = self._sp.bos_id()
        return ([bos] if bos >= 0 and add_bos else []) + self._sp.EncodeAsIds(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds(ids)


class TiktokenTokenizer:
    """Meta Llama 3's tiktoken-format ``tokenizer.model`` (``base64(bytes) rank`` lines).

    Rebuilt as a byte-level BPE with the ``tokenizers`` library (merges recovered from the
    ranks, as transformers' converter does). Special tokens follow the base vocabulary:
    ``<|begin_of_text|>`` = n (prepended), ``<|end_of_text|>`` = n + 1; for the 128k
    release vocabulary also ``<|eom_id|>`` / ``<|eot_id|>`` = n + 8 / n + 9 end a turn.
    Special-token text inside a prompt is encoded as plain text.
    """

    def __init__(self, path: Path) -> None:
        ranks = tiktoken_bpe.read_ranks(path)
        self._tok = tiktoken_bpe.build_tokenizer(ranks, [], None)
        self.n_base = len(ranks)
        self.eos_ids = [self.n_base + 1] + ([self.n_base + 8, self.n_base + 9] if self.n_base == 128000 else [])

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [self.n_base] * add_bos + self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i < self.n_base])


def _read_tokenizer_model(path: Path) -> Tokenizer:
    """Sentencepiece protobuf, or Meta Llama 3's tiktoken text format."""
    if tiktoken_bpe.is_rank_file(path):
        return TiktokenTokenizer(path)
    return SentencePieceTokenizer(path)


@contextlib.contextmanager
def tokenizer_folder(checkpoint: str | Path) -> Iterator[Path]:
    """The folder of ``checkpoint``'s tokenizer files while the block lasts: the checkpoint
    folder (or the folder of a file in it), or, for a one-file checkpoint that carries its
    tokenizer (a GGUF), the folder its format rebuilds the files in."""
    path = Path(checkpoint)
    if source_file_format(path) is None:
        yield path if path.is_dir() else path.parent
        return
    from ckptkit.checkpoint import open_checkpoint

    with open_checkpoint(path) as ckpt:
        yield ckpt.side_folder


def load_tokenizer(checkpoint: str | Path, eos_token_id: int | list[int] | None = None) -> Tokenizer:
    """The tokenizer stored with ``checkpoint`` (a checkpoint dir, a file inside one, or a GGUF).

    Prefers ``tokenizer.json``, then ``tokenizer.model``, then a ``tokenizer.model`` one
    level up (Meta downloads keep it beside the model folder). End-of-sequence ids are
    ``eos_token_id`` (from the model config) plus those in ``generation_config.json``.
    """
    with tokenizer_folder(checkpoint) as folder:
        tok: Tokenizer
        if (folder / "tokenizer.json").is_file():
            tok = HFTokenizer(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").is_file():
            tok = _read_tokenizer_model(folder / "tokenizer.model")
        elif (folder.parent / "tokenizer.model").is_file():
            tok = _read_tokenizer_model(folder.parent / "tokenizer.model")
        else:
            raise CkptkitError(f"no tokenizer found for {checkpoint} (expected tokenizer.json or tokenizer.model)")
        eos = set(tok.eos_ids) | set(_as_list(eos_token_id))
        gen_cfg = folder / "generation_config.json"
        if gen_cfg.is_file():
            eos |= set(_as_list(read_json(gen_cfg)[1].get("eos_token_id")))
    tok.eos_ids = sorted(eos)
    return tok


def _as_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)
