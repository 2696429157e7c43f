"""A sentencepiece BPE ``tokenizer.model`` (Llama 2, Mistral) as a fast ``tokenizer.json``.

Laid out as the official HF Llama 2 / Mistral ``tokenizer.json`` files are: the pieces as
a BPE vocabulary with byte fallback, merges recovered from the vocabulary order, a
normalizer that adds sentencepiece's dummy ``▁`` prefix and turns spaces into ``▁``,
control pieces as special added tokens, and a post-processor that puts BOS first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.tokenization.bpe import bos_template, merges_from_vocab
from ckptkit.tokenization.spm_proto import BPE, CONTROL, UNKNOWN, USER_DEFINED, SpmModel


def build_tokenizer(model: SpmModel, path: Path, add_bos: bool = True) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes like ``model`` (with BOS first when ``add_bos``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    if model.model_type != BPE:
        raise CkptkitError(f"{path}: only BPE sentencepiece models can be converted (this one is a unigram model)")
    vocab = {p.text: i for i, p in enumerate(model.pieces)}
    unk = model.pieces[model.unk_id].text if 0 <= model.unk_id < len(model.pieces) else None
    bpe = models.BPE(vocab, merges_from_vocab(vocab), unk_token=unk, fuse_unk=True, byte_fallback=model.byte_fallback)
    tok = Tokenizer(bpe)
    # Normalise like sentencepiece (dummy prefix on every text, spaces as ▁) rather than with a
    # Metaspace pre-tokenizer, which skips the prefix before a leading space.
    steps = [normalizers.Prepend("▁")] if model.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if model.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(p.text, normalized=False) for p in model.pieces if p.type in (UNKNOWN, CONTROL)])
    tok.add_tokens([AddedToken(p.text, normalized=False) for p in model.pieces if p.type == USER_DEFINED])
    if add_bos and 0 <= model.bos_id < len(model.pieces):
        tok.post_processor = bos_template(model.pieces[model.bos_id].text, model.bos_id)
    return tok


def special_piece(model: SpmModel, index: int) -> str | None:
    """The text of piece ``index`` (BOS, EOS, UNK, PAD ids), None when the model has none."""
    return model.pieces[index].text if 0 <= index < len(model.pieces) else None
