"""A sentencepiece BPE ``tokenizer.model`` (Llama 2, Mistral) as a fast ``tokenizer.json``.

Laid out as the official HF Llama 2 / Mistral ``tokenizer.json`` files are: the pieces as
a BPE vocabulary with byte fallback, merges ordered by the score of the piece they make
(as sentencepiece applies them), a normalizer that adds sentencepiece's dummy ``▁`` prefix and turns spaces into ``▁``
(after dropping leading, trailing and repeated spaces for a model that removes extra whitespace),
control pieces as special added tokens, and a post-processor that puts BOS first.
User-defined pieces are isolated by a pre-tokenizer and looked up whole, as sentencepiece
matches them (not added as tokens: HF's layout then puts a ``▁`` after each).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.tokenization.bpe import bos_template, scored_merges
from ckptkit.tokenization.spm_proto import BPE, BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Piece, SpmModel


class NotExact(CkptkitError):
    """A sentencepiece model that no ``tokenizer.json`` encodes exactly like (one line naming
    it); ``why`` says what stands in the way."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: cannot be converted to tokenizer.json exactly: {why}")
        self.why = why


def build_tokenizer(model: SpmModel, path: Path, add_bos: bool = True) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes like ``model`` (with BOS first when ``add_bos``);
    :class:`NotExact` when none can."""
    from tokenizers import AddedToken, Tokenizer, decoders

    why = unconvertible(model)
    if why is not None:
        raise NotExact(path, why)
    user = [p.text for p in model.pieces if p.type == USER_DEFINED]
    merges = scored_merges([(p.text, p.score) for p in model.pieces])
    tok = Tokenizer(_bpe(model, merges, ignore_merges=bool(user)))
    tok.normalizer = _normalizer(model)
    if user:
        tok.pre_tokenizer = _user_defined_split(user, model.byte_fallback)
        why = _whole_pieces_differ(model, merges, tok.pre_tokenizer)
        if why is not None:
            raise NotExact(path, why)
    decoding: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if model.add_dummy_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decoding)
    tok.add_special_tokens([AddedToken(p.text, normalized=False) for p in model.pieces if p.type in (UNKNOWN, CONTROL)])
    if add_bos and 0 <= model.bos_id < len(model.pieces):
        tok.post_processor = bos_template(model.pieces[model.bos_id].text, model.bos_id)
    return tok


def _normalizer(model: SpmModel) -> Any:
    """Sentencepiece's whitespace handling as normalizers: the dummy prefix on every text and
    spaces as ▁; with ``remove_extra_whitespaces``, first leading spaces dropped and each run
    of spaces kept as one (only U+0020: the identity normalizer maps nothing else to a space),
    and last every ▁ at the end dropped (sentencepiece strips the escaped text, so a ▁ typed
    at the end goes too). Normalizers rather than a Metaspace pre-tokenizer, which skips the
    prefix before a leading space."""
    from tokenizers import Regex, normalizers

    steps: list[Any] = []
    if model.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A "), "")]
    if model.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    if model.remove_extra_whitespaces:
        steps.append(normalizers.Replace(Regex(r"▁+\z"), ""))
    return normalizers.Sequence(steps)


def _bpe(model: SpmModel, merges: list[tuple[str, str]], ignore_merges: bool) -> Any:
    from tokenizers import models

    vocab = {p.text: i for i, p in enumerate(model.pieces)}
    unk = model.pieces[model.unk_id].text if 0 <= model.unk_id < len(model.pieces) else None
    return models.BPE(
        vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=model.byte_fallback, ignore_merges=ignore_merges
    )


# A word that is exactly a byte piece's text: split after its "<", so that the whole-piece
# lookup (``ignore_merges``) cannot turn the text "<0x41>" into the byte 0x41.
BYTE_TEXT = r"\A<(?=0x[0-9A-F]{2}>\z)"


def user_defined_pattern(texts: list[str]) -> str:
    """The regex that isolates user-defined pieces: longest first, as sentencepiece matches them."""
    return "|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))


def _user_defined_split(texts: list[str], byte_fallback: bool) -> Any:
    """Sentencepiece's user-defined pieces: matched in the normalized text (after the dummy
    prefix: ``"[X]a"`` is ``▁ [X] a``), emitted whole, never merged, and no new prefix after
    them. HF's layout of adding them as tokens splits them out of the raw text instead, so
    every text after one gets a ``▁`` that sentencepiece does not give (and one starting with
    one loses its ``▁``). Isolated here by the pre-tokenizer; BPE's ``ignore_merges`` turns
    the isolated text into its id (as transformers' own sentencepiece conversion does)."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(user_defined_pattern(texts)), "isolated")]
    if byte_fallback:
        steps.append(pre_tokenizers.Split(Regex(BYTE_TEXT), "isolated"))
    return pre_tokenizers.Sequence(steps)


def _whole_pieces_differ(model: SpmModel, merges: list[tuple[str, str]], pre_tokenizer: Any) -> str | None:
    """Why looking up whole words (``ignore_merges``, after ``pre_tokenizer``) would give other
    ids than sentencepiece's merges for some text; None when it would not. Only words that
    are pieces can differ: the text of each piece that can be a word (not a user-defined,
    control or unknown one, which never reach BPE as text) must give the same ids both ways."""
    from tokenizers import Tokenizer

    texts = [p.text for p in model.pieces if p.type not in (USER_DEFINED, CONTROL, UNKNOWN)]
    lookup, merged = (
        Tokenizer(_bpe(model, merges, ignore_merges=True)),
        Tokenizer(_bpe(model, merges, ignore_merges=False)),
    )
    lookup.pre_tokenizer = pre_tokenizer
    got = [[e.ids for e in tok.encode_batch(texts, add_special_tokens=False)] for tok in (lookup, merged)]
    for text, by_lookup, by_merges in zip(texts, *got, strict=True):
        if by_lookup != by_merges:
            return f"the piece {text!r} is not what sentencepiece makes of its own text"
    return None


def unconvertible(model: SpmModel) -> str | None:
    """Why ``model`` would encode differently as this ``tokenizer.json``; None when it would not.

    The layout reproduces sentencepiece's BPE with the identity normalizer and spaces
    escaped as ``▁``, kept as they are (Llama 2, Mistral) or with extra ones removed. A
    unigram model or a ``▁`` suffix would need more than that, and so would a normalization
    map (``nmt_nfkc``): sentencepiece applies the longest matching entry of its table
    anywhere in the text, while the ``tokenizers`` library's ``Precompiled`` normalizer (what
    transformers writes) maps whole grapheme clusters by their first mapped character and
    never composes across clusters: half-width katakana with a sound mark (``ﾊﾟ``), decomposed
    Hangul, a full-width letter with an accent come out otherwise."""
    if model.model_type != BPE:
        return "only BPE sentencepiece models can be converted (this one is a unigram model)"
    if model.precompiled_charsmap or model.normalizer_name not in ("", "identity"):
        name = model.normalizer_name or "a precompiled map"
        return (
            f"its normalizer ({name}) maps text by a table that tokenizer.json cannot apply as sentencepiece "
            "does (half-width katakana with sound marks, decomposed Hangul...)"
        )
    if model.remove_extra_whitespaces and any(p.type == USER_DEFINED for p in model.pieces):
        return "it removes extra whitespace around user-defined pieces, which sentencepiece matches unnormalized"
    if not model.escape_whitespaces or model.treat_whitespace_as_suffix:
        return "it does not mark spaces with a leading ▁"
    if len({p.text for p in model.pieces}) != len(model.pieces):
        return "two pieces have the same text"
    return None


def special_piece(model: SpmModel, index: int) -> str | None:
    """The text of piece ``index`` (BOS, EOS, UNK, PAD ids), None when the model has none."""
    return model.pieces[index].text if 0 <= index < len(model.pieces) else None


def _alternatives(regex: str) -> list[str]:
    """The texts of a ``user_defined_pattern`` (``re.escape``d texts joined by ``|``)."""
    texts, current, escaped = [], [], False
    for char in regex:
        if escaped or char not in "\\|":
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        else:
            texts.append("".join(current))
            current = []
    return [*texts, "".join(current)]


def _user_defined(pre: Any, byte_fallback: bool) -> list[str] | None:
    """The user-defined pieces a pre-tokenizer isolates as :func:`build_tokenizer` writes it
    ([] for no pre-tokenizer); None for any other pre-tokenizer."""
    if pre is None:
        return []
    try:
        texts = _alternatives(pre["pretokenizers"][0]["pattern"]["Regex"])
    except (KeyError, IndexError, TypeError):
        return None
    return texts if json.loads(_user_defined_split(texts, byte_fallback).__getstate__()) == pre else None


def _split(doc: dict[str, Any]) -> tuple[bool, list[str]] | None:
    """Whether a ``tokenizer.json`` splits text as sentencepiece does with (True) or without
    (False) the dummy ``▁`` prefix, and the user-defined pieces it isolates; None when it
    splits otherwise. The official Llama 2 / Mistral layout (a ``Prepend`` + ``Replace``
    normalizer) is exact; transformers 5's ``Metaspace`` pre-tokenizer (``prepend_scheme:
    first``) is not: it drops the prefix before a leading space (``"  a"``), which
    sentencepiece keeps."""
    norm, pre = doc.get("normalizer"), doc.get("pre_tokenizer")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    if isinstance(norm, dict) and norm.get("type") == "Sequence":
        steps = norm.get("normalizers") or []
        user = _user_defined(pre, bool((doc.get("model") or {}).get("byte_fallback")))
        if user is None or steps not in ([{"type": "Prepend", "prepend": "▁"}, replace], [replace]):
            return None
        return len(steps) == 2, user
    if norm is None and isinstance(pre, dict) and pre.get("type") == "Metaspace":
        # Metaspace adds no ▁ before a text that starts with a space, where sentencepiece
        # does: only its "never" scheme (no prefix at all) is exact.
        if pre.get("replacement") == "▁" and not pre.get("split", True) and pre.get("prepend_scheme") == "never":
            return False, []
    return None


def model_from_tokenizer_json(doc: dict[str, Any], config: dict[str, Any]) -> SpmModel | None:
    """The sentencepiece BPE model behind a Llama-2-style ``tokenizer.json`` (``config``: its
    ``tokenizer_config.json``, for BOS/EOS); None when the file is not one this module's
    layout can stand for (another model type or split, merges not in score order...).

    Scores follow the merge order (the first merge making a piece ranks it), so that
    sentencepiece prefers pieces in the order the file's merges do. The merges must be
    every split of the pieces they make (as HF's converter lists them; the order of the
    splits of one piece differs between transformers versions and does not matter)."""
    model = doc.get("model") or {}
    split = _split(doc)
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or split is None or not isinstance(vocab, dict) or model.get("dropout"):
        return None
    prefix, user = split
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    if bool(model.get("ignore_merges")) != bool(user) or not all(t in vocab for t in user):
        return None
    texts = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in texts] != list(range(len(texts))):
        return None
    added = {t["content"]: t for t in doc.get("added_tokens") or []}
    if any(vocab.get(name) != t["id"] for name, t in added.items()) or set(added) & set(user):
        return None
    # A token added to the raw text (not special) puts a ▁ before the text after it, which no
    # sentencepiece piece does: sentencepiece's user-defined pieces are the isolated ``user``.
    if any(not t.get("special") for t in added.values()):
        return None
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    rank: dict[str, int] = {}
    for i, (left, right) in enumerate(merges):
        rank.setdefault(left + right, i)
    byte_fallback = bool(model.get("byte_fallback"))
    unk = model.get("unk_token") or ("<unk>" if "<unk>" in vocab else None)
    pieces, user_set = [], set(user)
    for i, text in enumerate(texts):
        if text in added or text in user_set:
            kind = USER_DEFINED if text in user_set else UNKNOWN if text == unk else CONTROL
            pieces.append(Piece(text, 0.0, kind))
        elif byte_fallback and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            pieces.append(Piece(text, 0.0, BYTE))
        else:
            pieces.append(Piece(text, -float(rank.get(text, len(merges) + i)), NORMAL))
    spm = SpmModel(pieces, BPE, byte_fallback, normalizer_name="identity", add_dummy_prefix=prefix)
    spm.remove_extra_whitespaces = False

    def token(name: str) -> int:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab[value] if isinstance(value, str) and value in vocab else -1

    spm.unk_id = vocab[unk] if unk in vocab else -1
    spm.bos_id = token("bos_token") if "bos_token" in config else vocab.get("<s>", -1)
    spm.eos_id = token("eos_token") if "eos_token" in config else vocab.get("</s>", -1)
    if set(scored_merges([(p.text, p.score) for p in pieces])) != set(merges):
        return None  # merges that are not every split of the pieces they make
    return spm
