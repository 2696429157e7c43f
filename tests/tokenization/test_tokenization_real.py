"""The converted tokenizers give exactly the official tokenizers' ids on the real vocabularies.

Llama 2 (32000 sentencepiece pieces, rebuilt from llama.cpp's copy with Meta's scores),
Llama 3 (Meta's tiktoken rank file from ``llama-models``), Mistral v1 and v3 (the
sentencepiece models in ``mistral-common``'s wheel, v3 with 750 control tokens). The
references are the official tokenizers run on the same files (sentencepiece, Meta's
tiktoken tokenizer) and the ids in llama.cpp's own vocabulary tests (``.inp`` / ``.out``,
made with the official HF tokenizers). The converted ``tokenizer.json`` is read the way
transformers reads it (``AutoTokenizer`` without tiktoken, protobuf or sentencepiece) on
llama.cpp's texts, and with the ``tokenizers`` library on hypothesis-generated text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
from gguf_sections import kv_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.models.llama import LLAMA2_TOKENIZER, LLAMA3_1_TOKENIZER, LLAMA3_TOKENIZER
from ckptkit.models.mistral import MISTRAL_TOKENIZER
from ckptkit.tokenization.hf_files import build_hf_tokenizer

from reference_cache import cached_outputs
from tokenizer_helpers import (
    CORPUS,
    autotokenizer_without_extras,
    llama2_tokenizer_model,
    llama3_tokenizer_model,
    llama_cpp_dir,
    llama_cpp_vocab,
    mistral_tokenizer_models,
    vocab_tests,
    write_tiny_meta_llama3,
)

SPM_VOCABS = ("llama2", "mistral-v1", "mistral-v3")
LLAMA3_SPECS = ("llama3", "llama3_1")  # Llama 3's specials, and Llama 3.1 / 3.2's

# Pieces that stress tokenizers: whitespace runs, digits, emoji (with joiners and flags),
# code, CJK, combining marks, the ▁ sentencepiece uses for spaces, contractions.
FRAGMENTS = [" ", "  ", "   ", "    ", "\n", "\n\n", "\t", "\r\n", " \n ", "0", "7", "42", "2024", "3.14159",
             "1e-9", "😀", "🦙", "👨‍👩‍👧‍👦", "🇯🇵", "❤️", "def f(x):\n    return x + 1\n", "{\"a\": [1, 2]}",
             "if (a && b) { c++; }", "中文", "日本語", "한국어", "ü", "é", "\u0301", "▁", "▁▁", "\u200b", "'s", "'LL",
             "Hello", " world", "__init__", "<|", "|>", "[", "]", "<", ">", "ÿ", "\x00", "\x7f"]  # fmt: skip
TEXTS = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(FRAGMENTS)), max_size=14).map("".join)
# Llama 3's special tokens written in the text (3.1 renamed some of Llama 3's reserved ones).
LLAMA3_FRAGMENTS = [
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|start_header_id|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|reserved_special_token_250|>",
]
LLAMA3_TEXTS = st.lists(
    st.one_of(st.text(max_size=10), st.sampled_from(FRAGMENTS), st.sampled_from(LLAMA3_FRAGMENTS)), max_size=14
).map("".join)
# Mistral v3's user-defined pieces, the text of byte pieces, and control tokens written in
# the text, around each other and around spaces.
PIECE_FRAGMENTS = ["[REFERENCE_DOC_0]", "[REFERENCE_DOC_1]", "[REFERENCE_DOC_10]", "[REFERENCE_DOC_19]",
                   "[REFERENCE_DOC_", "<0x41>", "<0x0A>", "<0xFF>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                   "[control_12]", "<s>", "</s>", "<unk>"]  # fmt: skip
SPM_TEXTS = st.lists(
    st.one_of(st.text(max_size=10), st.sampled_from(FRAGMENTS), st.sampled_from(PIECE_FRAGMENTS)), max_size=14
).map("".join)
PIECE_TEXTS = [
    "[REFERENCE_DOC_1]hello",
    "[REFERENCE_DOC_1] hello",
    "a [REFERENCE_DOC_1] b",
    "x[REFERENCE_DOC_1]y",
    " [REFERENCE_DOC_1]",
    "  [REFERENCE_DOC_19]  ",
    "[REFERENCE_DOC_10][REFERENCE_DOC_1][REFERENCE_DOC_0]",
    "doc [REFERENCE_DOC_2]\n[REFERENCE_DOC_3]:\tend",
    "[REFERENCE_DOC_1]<0x41>",
    "[REFERENCE_DOC_1]<0x0A>[REFERENCE_DOC_2]",
    "<0xFF>",
    "[INST][REFERENCE_DOC_2] question[/INST] answer",
    "[REFERENCE_DOC_5][INST] hi",
    "</s>[REFERENCE_DOC_4]</s>",
    "[REFERENCE_DOC_20] [REFERENCE_DOC_] [REFERENCE_DOC_1",
    "▁[REFERENCE_DOC_7]▁",
    " ".join(f"[REFERENCE_DOC_{i}]x{i}" for i in range(20)),
]


def _with_specials(text: str, specials: dict[str, int], encode: Any) -> list[int]:
    """``encode`` (the official tokenizer) on the text between the special tokens written in
    ``text`` (leftmost, longest first), each special as its id: how HF's repos, Meta's
    tokenizer with ``allowed_special="all"`` and mistral-common's instruct encoding treat
    them (sentencepiece alone encodes them as text)."""
    ids, rest = [], text
    while rest:
        found = [(rest.find(s), -len(s), s) for s in specials if s in rest]
        if not found:
            return [*ids, *encode(rest)]
        at, _, special = min(found)
        ids += [*encode(rest[:at]), specials[special]]
        rest = rest[at + len(special) :]
    return ids


def _sp_ids(sp: Any, text: str) -> list[int]:
    """Sentencepiece's ids for ``text``, its control and unknown pieces written in the text
    (``[INST]``, ``</s>``) as their ids."""
    if sp not in _SP_SPECIALS:
        n = sp.get_piece_size()
        _SP_SPECIALS[sp] = {sp.id_to_piece(i): i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
    return _with_specials(text, _SP_SPECIALS[sp], sp.encode)


_SP_SPECIALS: dict[Any, dict[str, int]] = {}  # per sentencepiece processor: its control and unknown pieces


_LLAMA3_SPECIALS: dict[str, dict[str, int]] = {}


def _llama3_specials(name: str) -> dict[str, int]:
    """Llama 3's special tokens as llama.cpp's ggml-vocab-llama-bpe.gguf names them; Llama
    3.1 / 3.2's as Meta's tokenizer in llama-models names them."""
    if name not in _LLAMA3_SPECIALS:
        if name == "llama3":
            tokens = llama_cpp_vocab("llama-bpe")["tokenizer.ggml.tokens"]
            assert isinstance(tokens, list)
            _LLAMA3_SPECIALS[name] = {t: i for i, t in enumerate(tokens) if i >= 128000}
        else:
            _LLAMA3_SPECIALS[name] = dict(_meta_llama3().special_tokens)
    return _LLAMA3_SPECIALS[name]


def _spm_models() -> dict[str, Path]:
    mistral = mistral_tokenizer_models()
    return {"llama2": llama2_tokenizer_model(), "mistral-v1": mistral["v1"], "mistral-v3": mistral["v3"]}


@pytest.fixture(scope="session")
def real_hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Meta -> HF tokenizer folders for each real vocabulary."""
    root = tmp_path_factory.mktemp("real-tokenizers")
    # Llama 3 (not 3.1): the special tokens of llama.cpp's ggml-vocab-llama-bpe.gguf.
    jobs: dict[str, tuple[Any, Path, int]] = {"llama3": (LLAMA3_TOKENIZER, llama3_tokenizer_model(), 128256)}
    jobs["llama3_1"] = (LLAMA3_1_TOKENIZER, llama3_tokenizer_model(), 128256)
    for name, path in _spm_models().items():
        jobs[name] = (LLAMA2_TOKENIZER if name == "llama2" else MISTRAL_TOKENIZER, path, 32768)
    out = {}
    for name, (spec, path, vocab) in jobs.items():
        folder = root / name
        folder.mkdir()
        for file, data in build_hf_tokenizer(spec, path, vocab, 8192).files.items():
            (folder / file).write_bytes(data)
        out[name] = folder
    return out


def _fast(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _meta_llama3() -> Any:
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer(llama3_tokenizer_model())


@pytest.fixture(scope="session")
def autotokenizer(real_hf: dict[str, Path]) -> dict[str, dict]:
    """AutoTokenizer's ids (without tiktoken/protobuf/sentencepiece) on llama.cpp's texts and the corpus."""
    spm_texts = [t for t, _ in vocab_tests("llama-spm")] + CORPUS + PIECE_TEXTS
    bpe_texts = [t for t, _ in vocab_tests("llama-bpe")] + CORPUS
    names = [*LLAMA3_SPECS, *SPM_VOCABS]
    jobs = [(real_hf[n], bpe_texts if n in LLAMA3_SPECS else spm_texts, None) for n in names]
    return dict(zip(names, autotokenizer_without_extras(jobs), strict=True))


def test_llama2_gives_llama_cpp_official_ids(autotokenizer: dict[str, dict]) -> None:
    tests = vocab_tests("llama-spm")
    sp = spm.SentencePieceProcessor(model_file=str(llama2_tokenizer_model()))
    assert [sp.encode(t) for t, _ in tests] == [ids for _, ids in tests]  # the rebuilt model is Llama 2's
    got = autotokenizer["llama2"]
    assert got["plain"][: len(tests)] == [ids for _, ids in tests]
    assert got["ids"][: len(tests)] == [[1, *ids] for _, ids in tests]  # BOS, as HF's Llama 2 repos add it
    assert got["plain"][tests.index((" Hello world", [29871, 15043, 3186]))] == [29871, 15043, 3186]


@pytest.mark.parametrize("name", LLAMA3_SPECS)
def test_llama3_gives_llama_cpp_official_ids(name: str, autotokenizer: dict[str, dict]) -> None:
    tests = vocab_tests("llama-bpe")
    meta = _meta_llama3()
    assert [meta.encode(t, bos=False, eos=False) for t, _ in tests] == [ids for _, ids in tests]
    got = autotokenizer[name]
    assert got["plain"][: len(tests)] == [ids for _, ids in tests]
    assert got["ids"][: len(tests)] == [[128000, *ids] for _, ids in tests]


@pytest.mark.parametrize("name", SPM_VOCABS)
def test_sentencepiece_vocabularies_give_sentencepiece_ids(name: str, autotokenizer: dict[str, dict]) -> None:
    """llama.cpp's texts, the corpus, and texts around Mistral v3's user-defined pieces
    (``[REFERENCE_DOC_n]``: sentencepiece puts the dummy ▁ before one that starts the text
    and none after it), with and without BOS."""
    sp = spm.SentencePieceProcessor(model_file=str(_spm_models()[name]))
    texts = [t for t, _ in vocab_tests("llama-spm")] + CORPUS + PIECE_TEXTS
    got = autotokenizer[name]
    assert got["plain"] == [_sp_ids(sp, t) for t in texts]
    assert got["ids"] == [[sp.bos_id(), *_sp_ids(sp, t)] for t in texts]
    assert (got["bos"], got["eos"]) == (sp.bos_id(), sp.eos_id())


def test_mistral_v3_user_defined_pieces_are_isolated_as_sentencepiece_does(autotokenizer: dict[str, dict]) -> None:
    """Each user-defined piece is one id, with sentencepiece's ▁ before it at the start of
    a text and no ▁ after it (HF's layout of adding it as a token gives the opposite)."""
    sp = spm.SentencePieceProcessor(model_file=str(_spm_models()["mistral-v3"]))
    texts = [t for t, _ in vocab_tests("llama-spm")] + CORPUS + PIECE_TEXTS
    got = dict(zip(texts, autotokenizer["mistral-v3"]["plain"], strict=True))
    start, doc1 = sp.piece_to_id("▁"), sp.piece_to_id("[REFERENCE_DOC_1]")
    assert got["[REFERENCE_DOC_1]hello"] == [start, doc1, sp.piece_to_id("hello")]
    assert got["x[REFERENCE_DOC_1]y"] == [sp.piece_to_id("▁x"), doc1, sp.piece_to_id("y")]
    user = [i for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith("[REFERENCE_DOC_")]
    assert len(user) == 20 and not any(sp.is_control(i) for i in user)
    assert set(user) <= {i for ids in got.values() for i in ids}  # all 20, through PIECE_TEXTS


def test_llama3_tokens_and_merges_equal_llama_cpp_vocabulary(real_hf: dict[str, Path]) -> None:
    """Token list and the 280147 merges, in order, as in llama.cpp's ggml-vocab-llama-bpe.gguf."""
    fields = llama_cpp_vocab("llama-bpe")
    doc = json.loads((real_hf["llama3"] / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = {**doc["model"]["vocab"], **{t["content"]: t["id"] for t in doc["added_tokens"]}}
    assert sorted(tokens, key=tokens.__getitem__) == fields["tokenizer.ggml.tokens"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]]
    assert merges == fields["tokenizer.ggml.merges"]


@pytest.mark.parametrize("name", SPM_VOCABS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SPM_TEXTS)
def test_sentencepiece_vocabularies_match_sentencepiece_on_generated_text(
    name: str, text: str, real_hf: dict[str, Path]
) -> None:
    sp, fast = _spm_pair(name, real_hf)
    want = _sp_ids(sp, text)
    assert fast.encode(text, add_special_tokens=False).ids == want
    assert fast.encode(text).ids == [sp.bos_id(), *want]


_PAIRS: dict[str, Any] = {}


def _spm_pair(name: str, real_hf: dict[str, Path]) -> Any:
    if name not in _PAIRS:
        sp = spm.SentencePieceProcessor(model_file=str(_spm_models()[name]))
        _PAIRS[name] = (sp, _fast(real_hf[name]))
    return _PAIRS[name]


@pytest.mark.parametrize("name", LLAMA3_SPECS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=LLAMA3_TEXTS)
def test_llama3_matches_meta_tiktoken_tokenizer_on_generated_text(
    name: str, text: str, real_hf: dict[str, Path]
) -> None:
    """Meta's tokenizer on the text between special tokens written in it, each special as
    its id (``allowed_special="all"``, with Llama 3's own names for Llama 3)."""
    if name not in _PAIRS:
        _PAIRS[name] = (_meta_llama3(), _fast(real_hf[name]))
    meta, fast = _PAIRS[name]
    want = _with_specials(text, _llama3_specials(name), lambda t: meta.encode(t, bos=False, eos=False))
    assert fast.encode(text, add_special_tokens=False).ids == want
    assert fast.encode(text).ids == [meta.bos_id, *want]
    if name == "llama3_1":
        assert want == meta.encode(text, bos=False, eos=False, allowed_special="all")


def test_mistral_v3_control_tokens_are_single_ids(real_hf: dict[str, Path]) -> None:
    """Control tokens written in the text become their ids (as in HF's Mistral repos and
    mistral-common's instruct encoding); the text between them encodes as sentencepiece does."""
    sp, fast = _spm_pair("mistral-v3", real_hf)
    parts = ["Hi there", "[INST]", " What is 2 + 2?", "[/INST]", "4", "[TOOL_CALLS]", " []"]
    want = [sp.piece_to_id(p) if p.startswith("[") and p.endswith("]") and len(p) > 3 else sp.encode(p) for p in parts]
    flat = [i for w in want for i in (w if isinstance(w, list) else [w])]
    assert fast.encode("".join(parts), add_special_tokens=False).ids == flat
    assert [sp.piece_to_id(p) for p in ("[INST]", "[/INST]", "[TOOL_CALLS]")] == [3, 4, 5]


@pytest.mark.slow
def test_llama3_hf_folder_gives_llama_cpp_the_official_vocabulary(tmp_path: Path) -> None:
    """llama.cpp's converter recognises the pre-tokenizer (llama-bpe) of what Meta -> HF
    writes, and its GGUF token list and merges equal llama.cpp's own Llama 3 vocabulary."""
    from ckptkit.convert import ConvertOptions, convert

    write_tiny_meta_llama3(tmp_path / "meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    del params["use_scaled_rope"]  # Llama 3 (8B), whose vocabulary llama.cpp ships
    (tmp_path / "meta" / "params.json").write_text(json.dumps(params))
    convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))
    llama_cpp = llama_cpp_dir()
    out = tmp_path / "vocab.gguf"
    cmd = [sys.executable, "convert_hf_to_gguf.py", str(tmp_path / "hf"), "--vocab-only", "--outfile", str(out)]

    def run() -> None:
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        res = subprocess.run(cmd, cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    cached_outputs([tmp_path / "hf"], [cmd[1], cmd[3]], [out], run)  # llama.cpp's run for these inputs, made once
    ours, official = kv_values(out), llama_cpp_vocab("llama-bpe")
    assert ours["tokenizer.ggml.pre"] == "llama-bpe"
    for key in ("model", "tokens", "merges", "token_type", "bos_token_id"):
        assert ours[f"tokenizer.ggml.{key}"] == official[f"tokenizer.ggml.{key}"], key


@pytest.mark.parametrize("name", SPM_VOCABS)
def test_tokenizer_json_back_to_sentencepiece_gives_official_ids(
    name: str, real_hf: dict[str, Path], tmp_path: Path
) -> None:
    """HF -> Meta without a tokenizer.model: the sentencepiece model rebuilt from the
    tokenizer.json (Mistral v3: with its user-defined pieces) gives the official ids, and
    converting it back to HF gives the same files."""
    from ckptkit.tokenization.sentencepiece_bpe import model_from_tokenizer_json
    from ckptkit.tokenization.spm_proto import write_spm_model

    folder = real_hf[name]
    doc = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    model = model_from_tokenizer_json(doc, config)
    assert model is not None
    (tmp_path / "tokenizer.model").write_bytes(write_spm_model(model))
    rebuilt = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    official = spm.SentencePieceProcessor(model_file=str(_spm_models()[name]))
    texts = [t for t, _ in vocab_tests("llama-spm")] + CORPUS + PIECE_TEXTS
    assert [rebuilt.encode(t) for t in texts] == [official.encode(t) for t in texts]
    # Back to HF without a record: the same files, byte for byte.
    spec = LLAMA2_TOKENIZER if name == "llama2" else MISTRAL_TOKENIZER
    again = build_hf_tokenizer(spec, tmp_path / "tokenizer.model", 32768, 8192).files
    assert all(again[file] == (folder / file).read_bytes() for file in again)
    if name == "llama2":
        assert [rebuilt.encode(t) for t, _ in vocab_tests("llama-spm")] == [ids for _, ids in vocab_tests("llama-spm")]


def test_user_defined_pieces_added_as_tokens_are_not_written_as_sentencepiece(real_hf: dict[str, Path]) -> None:
    """A tokenizer.json that adds Mistral v3's user-defined pieces as (non-special) tokens, as
    HF's converter lays them out, puts a ▁ after each that sentencepiece does not: no
    sentencepiece model encodes like it, so none is written."""
    from tokenizers import Tokenizer

    from ckptkit.tokenization.sentencepiece_bpe import model_from_tokenizer_json

    doc = json.loads((real_hf["mistral-v3"] / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = doc["model"]["vocab"]
    user = [t for t in vocab if t.startswith("[REFERENCE_DOC_")]
    doc["pre_tokenizer"], doc["model"]["ignore_merges"] = None, False
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": False} for t in user]  # fmt: skip
    doc["added_tokens"] = sorted(doc["added_tokens"] + added, key=lambda t: t["id"])
    hf_layout = Tokenizer.from_str(json.dumps(doc))
    sp = spm.SentencePieceProcessor(model_file=str(_spm_models()["mistral-v3"]))
    assert hf_layout.encode("[REFERENCE_DOC_1]hello", add_special_tokens=False).ids != sp.encode(
        "[REFERENCE_DOC_1]hello"
    )
    assert model_from_tokenizer_json(doc, {}) is None
