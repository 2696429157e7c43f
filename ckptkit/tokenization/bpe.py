"""Pieces shared by the BPE conversions: merges recovered from a ranked vocabulary, the
byte-level alphabet, and the BOS post-processor."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any


def merges_from_vocab(vocab: dict[str, int], skip: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Every split of a vocabulary entry into two entries, as merges ranked by the id they
    produce (then by the length and ids of the halves): the order that reproduces
    rank-based BPE (sentencepiece, tiktoken) with the ``tokenizers`` library."""
    skipped = set(skip)
    found = []
    for token, rank in vocab.items():
        if token in skipped:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab and left not in skipped and right not in skipped:
                found.append((rank, len(left), len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[5], f[6]) for f in found]


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


def bytes_to_text(token: bytes) -> str:
    table = byte_to_char()
    return "".join(table[b] for b in token)


def text_to_bytes(token: str) -> bytes:
    table = char_to_byte()
    return bytes(table[c] for c in token)


def bos_template(bos: str, bos_id: int) -> Any:
    """A post-processor that puts ``bos`` before each sequence, as HF's Llama tokenizers do."""
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
