"""The ``tokenizer.ggml.*`` keys, as each llama.cpp model class's ``set_vocab`` writes them
from an HF folder's tokenizer files."""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError, FlagError, note
from ckptkit.formats.gguf.llama_cpp_pre import PRE_TOKENIZERS

PRE_OPTION = "--gguf-pre"
# what --gguf-pre may name: the pre-tokenizers llama.cpp's converter writes for a BPE tokenizer it recognises
PRE_NAMES = tuple(sorted(set(PRE_TOKENIZERS.values())))

CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


SPM = "tokenizer.model (sentencepiece)"
BPE = f"tokenizer.json (byte-level BPE) whose pre-tokenizer llama.cpp recognises, else {PRE_OPTION} NAME"
# what each set_vocab kind (GGUFSpec.vocab) takes: the support matrix's tokenizer condition
VOCAB_NEEDS = {
    "llama": f"{SPM} or {BPE}",
    "gemma": SPM,
    "phi3": f"{SPM}, or with GPT2Tokenizer {BPE}",
    "bpe_or_spm": f"{SPM} or {BPE}",
    "bpe": BPE,
    "glm": f"{BPE}, with GLM's special tokens ([gMASK] and its user, observation and end-of-text tokens)",
    "spm_unprefixed": SPM,
    "spm_unprefixed_or_bpe": f"{SPM} or {BPE}",
    "gemma4": "tokenizer.json (sentencepiece-style BPE)",
}
# Gemma 4's chat-format tokens that llama.cpp's gemma4 vocabulary always renders (user-defined)
GEMMA4_VISIBLE = frozenset(
    ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>')
)
# llama.cpp's _set_vocab_glm: special token kind -> the added token it names
GLM_SPECIALS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
VOCAB_ROWS = "with a tokenizer.json, a token for every embedding row (llama.cpp would drop the rest)"


def _look_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special``."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` ({} when absent), parsed once however often it is asked for
    (not to be changed)."""
    from ckptkit.formats.base import read_json_shared

    return read_json_shared(path) if path.is_file() else {}


def _llama_hf_style(doc: dict[str, Any]) -> bool:
    """Whether ``gguf.LlamaHfVocab`` takes this tokenizer.json for a sentencepiece-style BPE (byte
    fallback, a Sequence decoder), as llama.cpp's ``_set_vocab_llama_hf`` would; ckptkit's
    gpt2 path writes the others (llama.cpp's ``_set_vocab_gpt2``)."""
    model, decoder = doc.get("model"), doc.get("decoder")
    return (
        isinstance(model, dict)
        and model.get("type") == "BPE"
        and bool(model.get("byte_fallback", False))
        and isinstance(decoder, dict)
        and decoder.get("type") == "Sequence"
    )


def _normalization_note(path: Path, model: Any) -> list[str]:
    """A note when the sentencepiece model at ``path`` changes text before splitting it (a
    normalization table, extra whitespace removed): llama.cpp's sentencepiece tokenizer
    reads no GGUF key for either, as its converter writes none."""
    what = [f"maps text by its {model.normalizer_name or 'normalization'} table"] if model.precompiled_charsmap else []
    if model.remove_extra_whitespaces:
        what.append("removes extra whitespace")
    if not what:
        return []
    fact = f"{path.name} {' and '.join(what)} before splitting it, which llama.cpp's sentencepiece tokenizer does not"
    return [note(fact, "to get the model's own ids from llama.cpp, normalize text that way before it tokenizes")]


def sentencepiece_vocab(
    folder: Path, hparams: dict[str, Any], phi3: bool = False, notes: list[str] | None = None
) -> tuple[list[bytes], list[float], list[int]]:
    """llama.cpp's ``_create_vocab_sentencepiece`` (and Phi-3's variant), from ckptkit's
    reader of the sentencepiece format; what llama.cpp will not do as the model does goes
    into ``notes``."""
    from ckptkit.tokenization import spm_proto as spm

    path = folder / "tokenizer.model"
    if not path.is_file():
        raise FileNotFoundError(path)
    model = spm.read_spm_model(path)
    if notes is not None:
        notes.extend(_normalization_note(path, model))
    n = len(model.pieces)
    vocab_size = hparams.get("vocab_size") or n
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [spm.UNUSED] * vocab_size
    for i, piece in enumerate(model.pieces):
        if i >= vocab_size:
            break
        kind = piece.type if piece.type in (spm.UNKNOWN, spm.CONTROL, spm.UNUSED, spm.BYTE) else spm.NORMAL
        tokens[i], scores[i], types[i] = piece.text.encode(), piece.score, kind
    for key, tid in _read_json(folder / "added_tokens.json").items():
        if isinstance(tid, int) and tid < vocab_size:
            tokens[tid], scores[tid], types[tid] = key.encode(), -1000.0, spm.USER_DEFINED
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    sources = [(int(k), v) for k, v in decoder.items()]
    if phi3:
        sources += [(int(v["id"]), v) for v in _read_json(folder / "tokenizer.json").get("added_tokens", [])]
    for tid, data in sources:
        if tid >= vocab_size:
            continue
        token: str = data["content"]
        if phi3:
            types[tid] = spm.CONTROL if data.get("special") else spm.USER_DEFINED
        elif data.get("special") or _look_special(token):
            types[tid] = spm.CONTROL
        else:
            token = token.replace("\u2581", " ")
            types[tid] = spm.USER_DEFINED
        scores[tid], tokens[tid] = -1000.0, token.encode()
    return tokens, scores, types


def no_tokenizer(where: Path) -> CkptkitError:
    """The error for a source without tokenizer files, named by where the user put them."""
    from ckptkit.tokenization import TOKENIZER_OPTION

    return CkptkitError(
        f"{where}: no tokenizer.json or tokenizer.model; llama.cpp needs a tokenizer: pass {TOKENIZER_OPTION}"
    )


def check_pre_name(name: str) -> None:
    """Refuse a ``--gguf-pre`` name llama.cpp does not know, in one line."""
    if name not in PRE_NAMES:
        import difflib

        close = difflib.get_close_matches(name, PRE_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FlagError(f"{PRE_OPTION} {name}: not one of {', '.join(PRE_NAMES)}{hint}")


ASKED = f"as {PRE_OPTION} asks"
RECORDED = "as the source GGUF records"  # a GGUF source's own tokenizer.ggml.pre, when no --gguf-pre


def pre_tokenizer(path: Path, ids: list[int], given: str | None, notes: list[str], by: str = ASKED) -> str:
    """``tokenizer.ggml.pre`` for the tokenizer at ``path`` that encodes llama.cpp's probe text as
    ``ids``: the name llama.cpp's converter recognises it by, else the one ``--gguf-pre`` gives
    (or, ``by`` RECORDED, the one a GGUF source records)."""
    known = PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest())
    if by == RECORDED and known is not None:
        return known
    if given is None and known is None:
        raise CkptkitError(
            f"{path}: llama.cpp does not recognise this BPE pre-tokenizer (its encoding of llama.cpp's probe "
            f"text matches no known tokenizer), so its converter refuses it; if you know which one it uses "
            f"(a fine-tuned model's edited tokenizer), name it with {PRE_OPTION} NAME"
        )
    if given is None or given == known:
        return str(known or given)
    if known is not None:
        raise CkptkitError(f"{path}: llama.cpp recognises this pre-tokenizer as {known!r}; drop {PRE_OPTION} {given}")
    fact = (
        f"llama.cpp's converter would refuse {path} (it does not recognise its pre-tokenizer); written with "
        f"tokenizer.ggml.pre {given!r} {by}"
    )
    if same_split(path, given):
        notes.append(note(fact + f", whose split rule is the one {path.name} gives"))
    else:
        action = f"to be sure llama.cpp splits text as {path.name} does, compare their ids on your text"
        notes.append(note(fact, action))
    return given


def same_split(path: Path, pre: str) -> bool:
    """Whether ``tokenizer.json`` at ``path`` splits text by the regexes that llama.cpp's
    ``pre`` pre-tokenizer uses (for the pre-tokenizers whose regex ckptkit knows)."""
    from ckptkit.formats.gguf.tokenizer import PRE_TOKENIZER_RULES
    from ckptkit.tokenization.tiktoken_bpe import split_patterns

    rule = PRE_TOKENIZER_RULES.get(pre)
    return rule is not None and split_patterns(_read_json(path).get("pre_tokenizer")) == list(rule[0])


def bpe_vocab(
    folder: Path, hparams: dict[str, Any], given: str | None = None, notes: list[str] | None = None, by: str = ASKED
) -> tuple[list[str], list[int], str]:
    """llama.cpp's ``get_vocab_base`` for byte-level BPE, with the ``tokenizers`` library
    (``given``: ``--gguf-pre``, for a pre-tokenizer llama.cpp does not recognise; notes go to ``notes``)."""
    import gguf
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise no_tokenizer(folder)
    tok = Tokenizer.from_file(str(path))
    notes = [] if notes is None else notes
    pre = pre_tokenizer(path, tok.encode(CHKTXT, add_special_tokens=True).ids, given, notes, by)
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = hparams.get("vocab_size", len(vocab))
    reverse = {i: t for t, i in vocab.items()}
    added = {int(a["id"]): a for a in _read_json(path).get("added_tokens", [])}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            info = added[i]
            if not info.get("normalized", True) and not info.get("special"):
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if info.get("special") or _look_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types, pre


def special_vocab(folder: Path, **kwargs: Any) -> Any:
    """``gguf.SpecialVocab``, as the gguf-py that llama.cpp's converter vendors reads it: PyPI's
    gguf 0.19 does not yet default ``add_bos``/``add_eos`` to False for a ByteLevel post-processor
    (Llama 3), so ``tokenizer.ggml.add_eos_token`` would be missing."""
    import gguf

    special = gguf.SpecialVocab(folder, **kwargs)
    post = (_read_json(folder / "tokenizer.json").get("post_processor") or {}) if kwargs.get("load_merges") else {}
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    if any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in processors):
        added = special.add_special_token
        special.add_special_token = {"bos": added.get("bos", False), "eos": added.get("eos", False), **added}
    return special


def gemma4_keys(w: Any, folder: Path) -> None:
    """llama.cpp's gemma4 vocabulary: tokenizer.json's tokens as ``gguf.LlamaHfVocab`` reads
    them (its chat-format tokens user-defined), its merges, BOS added, no space prefix."""
    import gguf

    if not (folder / "tokenizer.json").is_file():
        raise no_tokenizer(folder)
    tokens, scores, types = [], [], []
    for text, score, kind in gguf.LlamaHfVocab(folder).all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in GEMMA4_VISIBLE else kind)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    special_vocab(folder, load_merges=True).add_to_gguf(w)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)


def add_vocab(
    w: Any, kind: str, folder: Path, hparams: dict[str, Any], pre: str | None = None, by: str = ASKED
) -> list[str]:
    """The ``tokenizer.ggml.*`` keys, as the ``set_vocab`` of a spec's ``vocab`` kind adds them
    (``pre``: ``--gguf-pre``, or ``by`` RECORDED a GGUF source's); returns notes on what
    llama.cpp will tokenize otherwise than the model's tokenizer."""
    import gguf

    if pre is not None:
        check_pre_name(pre)
    config = _read_json(folder / "tokenizer_config.json")
    notes: list[str] = []
    wrote_bpe = False

    def spm_keys(phi3: bool = False) -> int:
        tokens, scores, types = sentencepiece_vocab(folder, hparams, phi3, notes)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        return len(tokens)

    def gpt2_keys(specials: dict[str, str] | None = None) -> None:
        nonlocal wrote_bpe
        tokens, types, name = bpe_vocab(folder, hparams, pre, notes, by)
        wrote_bpe = True
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(name)
        w.add_token_list(tokens)
        w.add_token_types(types)
        special = special_vocab(folder, load_merges=True)
        added = {t["content"]: t["id"] for t in _read_json(folder / "tokenizer.json").get("added_tokens") or []}
        for kind, token in (specials or {}).items():
            if token not in added:
                raise CkptkitError(f"{folder}: tokenizer.json has no {token} token, which llama.cpp reads as {kind}")
            special._set_special_token(kind, added[token])
        special.add_to_gguf(w)

    if kind == "llama":
        if (prefix := config.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(prefix)
        if (folder / "tokenizer.model").is_file():
            gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        else:
            if _llama_hf_style(_read_json(folder / "tokenizer.json")):
                raise CkptkitError(
                    f"{folder}: a sentencepiece-style tokenizer.json without tokenizer.model is not supported"
                )
            gpt2_keys()
    elif kind == "gemma":
        gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        special = gguf.SpecialVocab(
            folder, load_merges=False, special_token_types=["prefix", "suffix", "middle", "fsep", "eot"]
        )
        for token, tid in (("prefix", 67), ("suffix", 69), ("middle", 68), ("fsep", 70), ("eot", 107)):
            special._set_special_token(token, tid)
        special.chat_template = None
        special.add_to_gguf(w)
        w.add_add_space_prefix(False)
    elif kind == "phi3":
        if config.get("tokenizer_class") == "GPT2Tokenizer":
            gpt2_keys()
        else:
            gguf.SpecialVocab(folder, n_vocab=spm_keys(phi3=True)).add_to_gguf(w)
    elif kind == "bpe_or_spm":  # qwen2
        if (folder / "tokenizer.model").is_file():
            gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)
        else:
            gpt2_keys()
    elif kind == "bpe":  # llama.cpp's TextModel default (OLMo 2)
        gpt2_keys()
    elif kind == "glm":  # GLM-4.5: its special tokens by name
        gpt2_keys(GLM_SPECIALS)
    elif kind == "spm_unprefixed" or (kind == "spm_unprefixed_or_bpe" and (folder / "tokenizer.model").is_file()):
        gguf.SpecialVocab(folder, n_vocab=spm_keys()).add_to_gguf(w)  # Gemma 2, Gemma 3
        w.add_add_space_prefix(False)
    elif kind == "spm_unprefixed_or_bpe":
        gpt2_keys()
    elif kind == "gemma4":
        gemma4_keys(w, folder)
    else:  # pragma: no cover - a spec naming a vocab kind this module lacks
        raise CkptkitError(f"no GGUF vocabulary writer {kind!r}")
    if pre is not None and not wrote_bpe and by == ASKED:
        raise CkptkitError(
            f"{folder}: {PRE_OPTION} names the pre-tokenizer of a byte-level BPE tokenizer.json; this one is "
            "sentencepiece's tokenizer.model, which has none: drop it"
        )
    return notes
