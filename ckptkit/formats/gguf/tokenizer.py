"""HF tokenizer files rebuilt from a GGUF's ``tokenizer.ggml.*`` metadata.

A sentencepiece vocabulary (``tokenizer.ggml.model = llama``) becomes a ``tokenizer.model``
(pieces, scores and types as stored; BPE with byte fallback and sentencepiece's dummy
prefix as ``add_space_prefix`` says) and the ``tokenizer.json`` ckptkit's converters make
from it; a byte-level BPE one (``gpt2``) becomes a ``tokenizer.json`` with the stored
vocabulary and merges, split by the pre-tokenizer ``tokenizer.ggml.pre`` names (the ones in
:data:`PRE_TOKENIZER_RULES`; for another, none, with a note); Gemma 4's (``gemma4``) becomes
the ``tokenizer.json`` of its character BPE. ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json`` carry the special tokens,
``add_bos``/``add_eos``, the chat template and llama.cpp's sampling keys.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ckptkit.errors import CkptkitError, note
from ckptkit.formats.gguf.reader import GGUFHeader, meta_bool, meta_int, meta_list, meta_str
from ckptkit.tokenization import spm_proto as spm
from ckptkit.tokenization.bpe import bos_template
from ckptkit.tokenization.tiktoken_bpe import LLAMA3_PATTERN

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# OpenAI's o200k split (gpt-oss's tokenizer, Llama 4's), as llama.cpp's gpt-4o and llama4 pre-tokenizers split
O200K_PATTERN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_LOWER}+{_SUFFIX}|[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_LOWER}*{_SUFFIX}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek V3's three splits in turn: digits by three, CJK runs, then words and punctuation (CR and
# LF written as the characters themselves, as the release's tokenizer.json has them)
DEEPSEEK_V3_PATTERNS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ).replace(r"\r\n", "\r\n"),
)
# tokenizer.ggml.pre -> (split regexes applied in turn, ignore_merges as llama.cpp's vocabulary loader
# takes them, NFC as the release tokenizers normalize text: Qwen2's; llama.cpp does not, nor does
# Qwen3.5's, whose split lets marks join letters instead). GLM-4.5's glm4 is Llama 3's split with the
# merges applied.
PRE_TOKENIZER_RULES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "llama-bpe": ((LLAMA3_PATTERN,), True, False),
    "qwen2": ((QWEN2_PATTERN,), False, True),
    "qwen35": ((QWEN35_PATTERN,), False, False),
    "glm4": ((LLAMA3_PATTERN,), False, False),
    "gpt-4o": ((O200K_PATTERN,), False, False),
    "llama4": ((O200K_PATTERN,), False, False),
    "deepseek-v3": (DEEPSEEK_V3_PATTERNS, False, False),
    # DeepSeek V3's tokenizer.json encoded without BOS (transformers 5): llama.cpp splits it as deepseek-v3
    "joyai-llm": (DEEPSEEK_V3_PATTERNS, False, False),
}
# general.sampling.* -> generation_config.json (the names llama.cpp reads them from)
SAMPLING = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "temp": "temperature"}
_PAD = re.compile(r"\[PAD\d+\]")
NO_TOKENIZER = "to use the model with a tokenizer, copy the original model's tokenizer files beside it"


def _json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _tokens(h: GGUFHeader) -> tuple[list[str], list[int]]:
    tokens = meta_list(h, "tokenizer.ggml.tokens", str)
    if not tokens:
        raise h.error("tokenizer.ggml.tokens is missing or empty")
    types = meta_list(h, "tokenizer.ggml.token_type", int) or [spm.NORMAL] * len(tokens)
    if len(types) != len(tokens) or any(not spm.NORMAL <= t <= spm.BYTE for t in types):
        raise h.error("tokenizer.ggml.token_type does not give a known type for each token")
    return tokens, types


def _special(h: GGUFHeader, tokens: list[str], what: str) -> int | None:
    tid = meta_int(h, f"tokenizer.ggml.{what}_token_id")
    if tid is not None and not 0 <= tid < len(tokens):
        raise h.error(f"tokenizer.ggml.{what}_token_id {tid} is not a token id (there are {len(tokens)})")
    return tid


def sentencepiece_model(h: GGUFHeader) -> spm.SpmModel:
    """The sentencepiece BPE model of a ``llama`` vocabulary; llama.cpp's ``[PAD{i}]`` fillers
    at the end (ids past the model's pieces) dropped."""
    tokens, types = _tokens(h)
    scores = meta_list(h, "tokenizer.ggml.scores", (float, int)) or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise h.error("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length")
    n = len(tokens)
    while n and types[n - 1] == spm.UNUSED and _PAD.fullmatch(tokens[n - 1]) and scores[n - 1] == -10000.0:
        n -= 1
    pieces = [spm.Piece(tokens[i], float(scores[i]), types[i]) for i in range(n)]
    model = spm.SpmModel(pieces, spm.BPE, any(t == spm.BYTE for t in types[:n]), normalizer_name="identity")
    model.remove_extra_whitespaces = False
    model.add_dummy_prefix = meta_bool(h, "tokenizer.ggml.add_space_prefix") is not False
    model.unk_id, model.bos_id, model.eos_id, model.pad_id = (
        -1 if (tid := _special(h, tokens, what)) is None or tid >= n else tid
        for what in ("unknown", "bos", "eos", "padding")
    )
    return model


def _bpe_tokenizer(h: GGUFHeader, add_bos: bool, bos: str | None, bos_id: int | None) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens, types = _tokens(h)
    pre = meta_str(h, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_RULES:
        known = ", ".join(PRE_TOKENIZER_RULES)
        raise CkptkitError(f"{h.path}: byte-level BPE pre-tokenizer {pre!r} is not one ckptkit rebuilds ({known})")
    patterns, ignore_merges, nfc = PRE_TOKENIZER_RULES[pre or ""]
    vocab, merges = _vocab_and_merges(h, tokens, types)
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, types)
    steps = [processors.ByteLevel(trim_offsets=False)]
    if add_bos and bos is not None and bos_id is not None:
        steps.append(bos_template(bos, bos_id))
    tok.post_processor = processors.Sequence(steps)
    return tok


def _gemma4_tokenizer(h: GGUFHeader, add_bos: bool, bos: str | None, bos_id: int | None, unk: str | None) -> Any:
    """llama.cpp's ``gemma4`` vocabulary as a ``tokenizer.json``: spaces as ``\u2581``, text split
    into runs of newlines and of anything else, then BPE over characters by the stored merges
    with byte fallback (no byte-level mapping, no space prefix)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types = _tokens(h)
    vocab, merges = _vocab_and_merges(h, tokens, types)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_tokens(tok, tokens, types)
    if add_bos and bos is not None and bos_id is not None:
        tok.post_processor = bos_template(bos, bos_id)
    return tok


def _vocab_and_merges(
    h: GGUFHeader, tokens: list[str], types: list[int]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """token -> id, and ``tokenizer.ggml.merges`` as pairs; a one-line error when they disagree.
    llama.cpp's ``[PAD{i}]`` fillers (ids the source tokenizer did not have) stay holes."""
    merges = [tuple(m.split(" ", 1)) for m in meta_list(h, "tokenizer.ggml.merges", str) or []]
    filler = [k == spm.UNUSED and _PAD.fullmatch(t) is not None for t, k in zip(tokens, types, strict=True)]
    vocab = {t: i for i, t in enumerate(tokens) if not filler[i]}
    named = any(len(m) != 2 or m[0] not in vocab or m[1] not in vocab for m in merges)
    if len(vocab) + sum(filler) != len(tokens) or named:
        raise h.error("tokenizer.ggml.tokens repeats a token, or tokenizer.ggml.merges names a token it lacks")
    return vocab, merges


def _add_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as added tokens, as llama.cpp matches them."""
    from tokenizers import AddedToken

    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in kinds if k == spm.CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in kinds if k == spm.USER_DEFINED])


def tokenizer_files(h: GGUFHeader, max_positions: int | None) -> tuple[dict[str, bytes], list[str]]:
    """(file name -> content, notes): the HF tokenizer files (and a sentencepiece
    ``tokenizer.model``) that the metadata describes; none, with a note, when it has no
    tokenizer or one ckptkit cannot rebuild exactly."""
    kind = meta_str(h, "tokenizer.ggml.model")
    if kind is None or kind == "none":
        return {}, [note("the GGUF holds no tokenizer: the output has none", NO_TOKENIZER)]
    if kind not in ("llama", "gpt2", "gemma4"):
        fact = f"tokenizer.ggml.model {kind!r} is not one ckptkit rebuilds (llama, gpt2, gemma4): the output has none"
        return {}, [note(fact, NO_TOKENIZER)]
    tokens, _ = _tokens(h)
    ids = {what: _special(h, tokens, what) for what in ("bos", "eos", "unknown", "padding")}
    add_bos = meta_bool(h, "tokenizer.ggml.add_bos_token")
    add_eos = meta_bool(h, "tokenizer.ggml.add_eos_token")
    files: dict[str, bytes] = {}
    if kind == "llama":
        from ckptkit.tokenization.sentencepiece_bpe import NotExact, build_tokenizer

        model = sentencepiece_model(h)
        add_bos = add_bos is not False
        try:
            tok = build_tokenizer(model, h.path, add_bos=add_bos)
        except NotExact as e:
            fact = f"the GGUF's sentencepiece vocabulary cannot be written as tokenizer.json ({e.why})"
            return {}, [note(fact, NO_TOKENIZER)]
        files["tokenizer.model"] = spm.write_spm_model(model)
    elif kind == "gemma4":
        add_bos = add_bos is not False
        bos_id, unk_id = ids["bos"], ids["unknown"]
        bos, unk = (tokens[i] if i is not None else None for i in (bos_id, unk_id))
        tok = _gemma4_tokenizer(h, add_bos, bos, bos_id, unk)
    elif (pre := meta_str(h, "tokenizer.ggml.pre", "default")) not in PRE_TOKENIZER_RULES:
        known = ", ".join(PRE_TOKENIZER_RULES)
        fact = f"byte-level BPE pre-tokenizer {pre!r} is not one ckptkit rebuilds ({known}): the output has none"
        return {}, [note(fact, NO_TOKENIZER)]
    else:
        bos_id = ids["bos"]
        tok = _bpe_tokenizer(h, bool(add_bos), tokens[bos_id] if bos_id is not None else None, bos_id)
    named = {
        f"{what}_token": tokens[tid]
        for what, tid in (("bos", ids["bos"]), ("eos", ids["eos"]), ("unk", ids["unknown"]), ("pad", ids["padding"]))
        if tid is not None
    }
    config: dict[str, Any] = {
        **named,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if max_positions is not None:
        config["model_max_length"] = max_positions
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if add_eos is not None:
        config["add_eos_token"] = add_eos
    if (template := meta_str(h, "tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    files["tokenizer.json"] = tok.to_str(pretty=True).encode("utf-8")
    files["tokenizer_config.json"] = _json(config)
    files["special_tokens_map.json"] = _json(named)
    files["generation_config.json"] = _json(generation_config(h, ids))
    return files, []


def generation_config(h: GGUFHeader, ids: dict[str, int | None]) -> dict[str, Any]:
    """``generation_config.json``: the special ids and llama.cpp's ``general.sampling.*`` keys."""
    out: dict[str, Any] = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"]}
    out = {k: v for k, v in out.items() if v is not None}
    for key, name in SAMPLING.items():
        value = h.metadata.get(f"general.sampling.{key}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    if any(name in out for name in SAMPLING.values()):
        out["do_sample"] = True
    return out
