"""Pieces shared by the BPE conversions: merges recovered from a ranked (tiktoken) or scored
(sentencepiece) vocabulary, the byte-level alphabet, and the BOS post-processor."""

from __future__ import annotations

import functools
from typing import Any


def _splits(token: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of ``token`` into two vocabulary entries, ordered by the halves' ids."""
    get = vocab.get
    found = []
    for i in range(1, len(token)):
        left = get(token[:i])
        if left is not None:
            right = get(token[i:])
            if right is not None:
                found.append((left, right, i))
    if len(found) > 1:
        found.sort()  # by the halves' ids (two splits never share both)
    return [(token[:i], token[i:]) for _, _, i in found]


def ranked_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges of a rank-ordered vocabulary (tiktoken): every split of an entry into two
    entries, ordered by the rank of the entry they make, then by the ranks of the halves.

    This is the order of the official Llama 3 ``tokenizer.json`` (transformers'
    ``TikTokenConverter``), which llama.cpp copies into GGUF: ranks break ties between
    pairs that make the same token, so the order is part of the tokenizer."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        if len(token) > 1:
            merges += _splits(token, vocab)
    return merges


def scored_merges(pieces: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """The merges of a sentencepiece BPE vocabulary (``(piece, score)`` by id): every split of
    a piece into two pieces, ordered by the score of the piece they make, highest first
    (sentencepiece merges the best-scored pair first), then by the piece's id, then by the
    halves' ids.

    This is the order of transformers' ``SentencePieceExtractor`` (the official Llama 2 and
    Mistral ``tokenizer.json``). Ordering by id instead is wrong: Llama 2 scores some
    whitespace pieces ``-1e9`` (``"▁▁"`` is id 259), and sentencepiece merges those last."""
    vocab = {text: i for i, (text, _) in enumerate(pieces)}
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i][1])  # stable: ties keep id order
    merges = []
    for i in order:
        merges.extend(_splits(pieces[i][0], vocab))
    return merges


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


@functools.cache
def _byte_table() -> list[str]:
    """``byte_to_char`` as a ``str.translate`` table over latin-1 code points."""
    return [byte_to_char()[b] for b in range(256)]


def bytes_to_text(token: bytes) -> str:
    return token.decode("latin-1").translate(_byte_table())


def text_to_bytes(token: str) -> bytes:
    table = char_to_byte()
    return bytes(table[c] for c in token)


def bos_template(bos: str, bos_id: int) -> Any:
    """A post-processor that puts ``bos`` before each sequence, as HF's Llama tokenizers do."""
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
