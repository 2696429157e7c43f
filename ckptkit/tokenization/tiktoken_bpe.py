"""Meta Llama 3's tiktoken rank file <-> a byte-level BPE ``tokenizer.json``.

The rank file is one ``base64(token bytes) rank`` line per token, in rank order. The
special tokens are not in it: Meta's code appends them after the last rank, in a fixed
order. Converting back keeps only the ranked tokens and writes the lines exactly as
Meta's file has them, so a rank file survives a trip through ``tokenizer.json`` byte
for byte.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.io import open_source, read_at, read_file
from ckptkit.tokenization.bpe import bos_template, bytes_to_text, ranked_merges, text_to_bytes

# Llama 3's pre-tokenizer split (the ``pat_str`` of Meta's tokenizer).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def is_rank_file(path: Path) -> bool:
    """Whether ``path`` starts like a tiktoken rank file (rather than a sentencepiece protobuf)."""
    src = open_source(path)
    try:
        head = bytes(read_at(src, 0, min(256, src.size())))
    finally:
        src.close()
    try:
        first = head.decode("ascii").split("\n", 1)[0].split()
        if len(first) == 2 and first[1].isdigit():
            base64.b64decode(first[0], validate=True)
            return True
    except (UnicodeDecodeError, ValueError):
        pass
    return False


def read_ranks(path: Path) -> dict[bytes, int]:
    """Token bytes -> rank, from a rank file; a one-line error naming it when malformed."""
    ranks: dict[bytes, int] = {}
    try:
        text = read_file(path).decode("ascii")
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"line {number} is not 'token rank'")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
    except (UnicodeDecodeError, ValueError, binascii.Error) as e:
        raise CkptkitError(f"{path}: malformed tiktoken rank file ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CkptkitError(f"{path}: tiktoken ranks are not 0..{len(ranks) - 1}")
    return ranks


def ranks_text(ranks: dict[bytes, int]) -> bytes:
    """The rank file for ``ranks``, in Meta's layout."""
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=_rank)]
    return "".join(lines).encode("ascii")


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def build_tokenizer(
    ranks: dict[bytes, int], specials: list[str], bos: str | None, pattern: str = LLAMA3_PATTERN
) -> Any:
    """A ``tokenizers.Tokenizer`` encoding like Meta's tiktoken tokenizer: text split by
    ``pattern`` (its ``pat_str``: Llama 3's by default), ranked tokens, then ``specials``
    with ids following the last rank, BOS added by the post-processor."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {bytes_to_text(tok): rank for tok, rank in ranks.items()}
    bpe = models.BPE(vocab, ranked_merges(vocab), ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        steps.append(bos_template(bos, len(ranks) + specials.index(bos)))
    tok.post_processor = processors.Sequence(steps)
    return tok


def split_patterns(node: Any) -> list[str]:
    """The regexes of every ``Split`` step in a serialised pre-tokenizer."""
    if isinstance(node, list):
        return [p for item in node for p in split_patterns(item)]
    if not isinstance(node, dict):
        return []
    found = [node["pattern"]["Regex"]] if node.get("type") == "Split" and "Regex" in node.get("pattern", {}) else []
    return found + split_patterns(node.get("pretokenizers"))


def ranks_from_tokenizer_json(path: Path) -> dict[bytes, int] | None:
    """The rank table behind a Llama-3-style byte-level BPE ``tokenizer.json``; None when the
    file is not one (another model type, another pre-tokenizer, or ids that are not ranks)."""
    try:
        doc = json.loads(read_file(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CkptkitError(f"{path}: unreadable tokenizer.json ({e})") from None
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or LLAMA3_PATTERN not in split_patterns(doc.get("pre_tokenizer")):
        return None
    added = {t["content"] for t in doc.get("added_tokens") or []}
    try:
        ranks = {text_to_bytes(t): i for t, i in model["vocab"].items() if t not in added}
    except KeyError:  # a character outside the byte-level alphabet
        return None
    if sorted(ranks.values()) != list(range(len(ranks))):
        return None
    return ranks
