"""The HF tokenizer folder files made from a Meta ``tokenizer.model``.

``tokenizer.json`` (the fast tokenizer), ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json``, plus the bos/eos/pad ids
that ``config.json`` repeats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError, note
from ckptkit.models.tokenizer_spec import TIKTOKEN, TokenizerSpec
from ckptkit.tokenization import sentencepiece_bpe, tiktoken_bpe
from ckptkit.tokenization.spm_proto import SpmModel, read_spm_model


@dataclass
class HFTokenizer:
    """A converted tokenizer: the files to write and the ids ``config.json`` carries."""

    files: dict[str, bytes]
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    notes: list[str] = field(default_factory=list)


def _json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _fast_tokenizer(spec: TokenizerSpec, model_path: Path, vocab_size: int) -> tuple[Any, list[str], Any]:
    """The ``tokenizers.Tokenizer`` (None, with a note, for a sentencepiece model that none
    encodes exactly like), notes, and the parsed sentencepiece model (None for tiktoken) for
    ``model_path``."""
    notes: list[str] = []
    if spec.kind == TIKTOKEN:
        if not tiktoken_bpe.is_rank_file(model_path):
            raise CkptkitError(f"{model_path}: expected Meta's tiktoken rank file for this Llama 3 model")
        ranks = tiktoken_bpe.read_ranks(model_path)
        room = vocab_size - len(ranks)
        if room < 0:
            raise CkptkitError(f"{model_path}: {len(ranks)} tokens, more than the model's vocabulary of {vocab_size}")
        specials = list(spec.specials[:room])
        if len(specials) < len(spec.specials):
            notes.append(
                note(
                    f"{model_path.name}: the model's vocabulary has room for {room} of Meta's "
                    f"{len(spec.specials)} special tokens, so the tokenizer has the first {room}"
                )
            )
        if spec.bos not in specials:
            raise CkptkitError(f"{model_path}: the model's vocabulary has no room for {spec.bos}")
        return tiktoken_bpe.build_tokenizer(ranks, specials, spec.bos), notes, None
    model = read_spm_model(model_path)
    if len(model.pieces) > vocab_size:
        raise CkptkitError(f"{model_path}: {len(model.pieces)} pieces, more than the model's {vocab_size} embeddings")
    try:
        return sentencepiece_bpe.build_tokenizer(model, model_path), notes, model
    except sentencepiece_bpe.NotExact as e:
        fact = f"the output has no tokenizer.json: {model_path.name} cannot be written as one exactly: {e.why}"
        return None, [note(fact, "to tokenize, load the output's tokenizer.model with sentencepiece")], model


def _token_id(tok: Any, text: str | None) -> int | None:
    return tok.token_to_id(text) if text is not None else None


class _Pieces:
    """The ``token_to_id`` of a sentencepiece model, for one no ``tokenizer.json`` stands for."""

    def __init__(self, model: SpmModel) -> None:
        self.ids: dict[str, int] = {}
        for i, piece in enumerate(model.pieces):
            self.ids.setdefault(piece.text, i)

    def token_to_id(self, text: str) -> int | None:
        return self.ids.get(text)


def build_hf_tokenizer(spec: TokenizerSpec, model_path: Path, vocab_size: int, max_positions: int) -> HFTokenizer:
    """The HF tokenizer files for Meta's ``model_path`` (sentencepiece or tiktoken); for a
    sentencepiece model no ``tokenizer.json`` encodes exactly like, only
    ``generation_config.json`` (and a note saying why)."""
    tok, notes, model = _fast_tokenizer(spec, model_path, vocab_size)
    if model is None:
        bos, eos, unk = spec.bos, spec.eos, None
    else:
        bos, eos, unk = (sentencepiece_bpe.special_piece(model, i) for i in (model.bos_id, model.eos_id, model.unk_id))
    named = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    named = {k: v for k, v in named.items() if v is not None}
    config: dict[str, Any] = {
        **named,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_positions,
        # The generic fast class uses tokenizer.json as it is; transformers 5's LlamaTokenizer
        # rebuilds the pre-tokenizer and then drops sentencepiece's prefix before a leading space.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if spec.kind != TIKTOKEN:
        config.update(add_bos_token=bos is not None, add_eos_token=False)
    if spec.chat_template:
        config["chat_template"] = spec.chat_template
    ids = tok if tok is not None else _Pieces(model)
    bos_id, eos_id = _token_id(ids, bos), _token_id(ids, eos)
    stop = [i for i in (_token_id(ids, s) for s in spec.stop) if i is not None]
    gen_eos: int | list[int] | None = stop if len(stop) > 1 else eos_id
    generation: dict[str, Any] = {k: v for k, v in spec.generation.items() if k != "pad_token"}
    pad_id = _token_id(ids, spec.generation.get("pad_token"))
    generation.update(bos_token_id=bos_id, eos_token_id=gen_eos)
    if pad_id is not None:
        generation["pad_token_id"] = pad_id
    files = {"generation_config.json": _json({k: v for k, v in generation.items() if v is not None})}
    if tok is not None:
        files["tokenizer.json"] = tok.to_str(pretty=True).encode("utf-8")
        files["tokenizer_config.json"] = _json(config)
        files["special_tokens_map.json"] = _json(named)
    return HFTokenizer(files, bos_id, gen_eos, notes)
