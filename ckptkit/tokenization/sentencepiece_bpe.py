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
from ckptkit.tokenization.spm_proto import BPE, CONTROL, UNKNOWN, USER_DEFINED, SpmModel


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
