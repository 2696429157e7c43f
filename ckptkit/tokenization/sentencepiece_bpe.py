"""A sentencepiece BPE ``tokenizer.model`` (Llama 2, Mistral) as a fast ``tokenizer.json``.

Laid out as the official HF Llama 2 / Mistral ``tokenizer.json`` files are: the pieces as
a BPE vocabulary with byte fallback, merges ordered by the score of the piece they make
(as sentencepiece applies them), a normalizer that adds sentencepiece's dummy ``▁`` prefix and turns spaces into ``▁``,
control pieces as special added tokens, and a post-processor that puts BOS first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.tokenization.bpe import bos_template, scored_merges
from ckptkit.tokenization.spm_proto import BPE, BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Piece, SpmModel


def build_tokenizer(model: SpmModel, path: Path, add_bos: bool = True) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes like ``model`` (with BOS first when ``add_bos``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    why = unconvertible(model)
    if why is not None:
        raise CkptkitError(f"{path}: cannot be converted to tokenizer.json exactly: {why}")
    vocab = {p.text: i for i, p in enumerate(model.pieces)}
    unk = model.pieces[model.unk_id].text if 0 <= model.unk_id < len(model.pieces) else None
    merges = scored_merges([(p.text, p.score) for p in model.pieces])
    bpe = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=model.byte_fallback)
    tok = Tokenizer(bpe)
    # Normalise like sentencepiece (dummy prefix on every text, spaces as ▁) rather than with a
    # Metaspace pre-tokenizer, which skips the prefix before a leading space.
    steps = [normalizers.Prepend("▁")] if model.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decoding: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if model.add_dummy_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decoding)
    tok.add_special_tokens([AddedToken(p.text, normalized=False) for p in model.pieces if p.type in (UNKNOWN, CONTROL)])
    tok.add_tokens([AddedToken(p.text, normalized=False) for p in model.pieces if p.type == USER_DEFINED])
    if add_bos and 0 <= model.bos_id < len(model.pieces):
        tok.post_processor = bos_template(model.pieces[model.bos_id].text, model.bos_id)
    return tok


def unconvertible(model: SpmModel) -> str | None:
    """Why ``model`` would encode differently as this ``tokenizer.json``; None when it would not.

    The layout reproduces sentencepiece's BPE with the identity normalizer, spaces escaped
    as ``▁`` and kept as they are (Llama 2, Mistral). A unigram model, a normalization
    map (``nmt_nfkc``), collapsed whitespace or a ``▁`` suffix would need more than that."""
    if model.model_type != BPE:
        return "only BPE sentencepiece models can be converted (this one is a unigram model)"
    if model.precompiled_charsmap or model.normalizer_name not in ("", "identity"):
        return f"its normalizer ({model.normalizer_name or 'a precompiled map'}) is not the identity"
    if model.remove_extra_whitespaces:
        return "it removes extra whitespace (remove_extra_whitespaces)"
    if not model.escape_whitespaces or model.treat_whitespace_as_suffix:
        return "it does not mark spaces with a leading ▁"
    if len({p.text for p in model.pieces}) != len(model.pieces):
        return "two pieces have the same text"
    return None


def special_piece(model: SpmModel, index: int) -> str | None:
    """The text of piece ``index`` (BOS, EOS, UNK, PAD ids), None when the model has none."""
    return model.pieces[index].text if 0 <= index < len(model.pieces) else None


def _dummy_prefix(doc: dict[str, Any]) -> bool | None:
    """Whether a ``tokenizer.json`` splits text as sentencepiece does with (True) or without
    (False) the dummy ``▁`` prefix; None when it splits otherwise. The official Llama 2 /
    Mistral layout (a ``Prepend`` + ``Replace`` normalizer) is exact; transformers 5's
    ``Metaspace`` pre-tokenizer (``prepend_scheme: first``) is not: it drops the prefix
    before a leading space (``"  a"``), which sentencepiece keeps."""
    norm, pre = doc.get("normalizer"), doc.get("pre_tokenizer")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    if pre is None and isinstance(norm, dict) and norm.get("type") == "Sequence":
        steps = norm.get("normalizers") or []
        if steps == [{"type": "Prepend", "prepend": "▁"}, replace]:
            return True
        if steps == [replace]:
            return False
        return None
    if norm is None and isinstance(pre, dict) and pre.get("type") == "Metaspace":
        # Metaspace adds no ▁ before a text that starts with a space, where sentencepiece
        # does: only its "never" scheme (no prefix at all) is exact.
        if pre.get("replacement") == "▁" and not pre.get("split", True) and pre.get("prepend_scheme") == "never":
            return False
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
    prefix = _dummy_prefix(doc)
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or prefix is None or not isinstance(vocab, dict) or model.get("dropout"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("ignore_merges"):
        return None
    texts = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in texts] != list(range(len(texts))):
        return None
    added = {t["content"]: t for t in doc.get("added_tokens") or []}
    if any(vocab.get(name) != t["id"] for name, t in added.items()):
        return None
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    rank: dict[str, int] = {}
    for i, (left, right) in enumerate(merges):
        rank.setdefault(left + right, i)
    byte_fallback = bool(model.get("byte_fallback"))
    unk = model.get("unk_token") or ("<unk>" if "<unk>" in vocab else None)
    pieces = []
    for i, text in enumerate(texts):
        if text in added:
            kind = UNKNOWN if text == unk else CONTROL if added[text].get("special") else USER_DEFINED
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
