"""The tokenizer rebuilt when a GGUF of the newer families is read: GLM-4.5's ``glm4``,
gpt-oss's ``gpt-4o`` (and Llama 4's ``llama4``, the same o200k split), Gemma 4's ``gemma4``
vocabulary. Each gives the ids of the tokenizer the GGUF was written from, on
``fixtures/corpus.txt``, the tokenizer tests' corpus and llama.cpp's vocabulary test texts."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES


@functools.cache
def texts() -> list[str]:
    """corpus.txt (by line and whole), the tokenizer tests' corpus, llama.cpp's test texts, a
    decomposed accent."""
    from tokenizer_helpers import CORPUS, llama_cpp_dir

    inp = llama_cpp_dir() / "models" / "ggml-vocab-llama-bpe.gguf.inp"
    tests = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    corpus = (FIXTURES / "corpus.txt").read_text(encoding="utf-8")
    decomposed = "cafe\u0301 na\u0308ive"  # NFC composes it (Qwen's tokenizers), llama.cpp does not
    return [*CORPUS, *tests, *corpus.split("\n"), corpus, decomposed]


def read_back(src: Path, tmp_path: Path, pre: str | None) -> tuple[Path, list[str]]:
    """``src`` to GGUF (with ``--gguf-pre pre``) and back to HF: the folder and the notes."""
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=pre))
    result = convert(tmp_path / "m.gguf", tmp_path / "back", ConvertOptions("hf"))
    return tmp_path / "back", result.notes


def assert_same_ids(original: Path, rebuilt: Path, cases: list[str], decoded: bool = True, split: bool = True) -> None:
    """Both ``tokenizer.json`` give the same ids for every text, with and without special tokens,
    (``decoded``) decode them to the same text and (``split``) split it into the same pieces (which
    a tiny vocabulary alone would not tell apart)."""
    from tokenizers import Tokenizer

    a, b = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (original, rebuilt))
    if split:
        assert [b.pre_tokenizer.pre_tokenize_str(t) for t in cases] == [
            a.pre_tokenizer.pre_tokenize_str(t) for t in cases
        ]
    for special in (False, True):
        want = [a.encode(t, add_special_tokens=special).ids for t in cases]
        assert [b.encode(t, add_special_tokens=special).ids for t in cases] == want
    if decoded:
        assert [b.decode(b.encode(t).ids) for t in cases] == [a.decode(a.encode(t).ids) for t in cases]


@pytest.mark.parametrize(
    ("fixture", "pre"), [("glm4_moe", "glm4"), ("gpt_oss", "gpt-4o"), ("gpt_oss", "llama4")], ids=lambda v: v
)
def test_byte_level_bpe_rebuilt_gives_the_source_ids(fixture: str, pre: str, tmp_path: Path) -> None:
    src = FIXTURES / "hf" / fixture
    back, notes = read_back(src, tmp_path, pre)
    assert notes == []
    assert_same_ids(src, back, texts())


def test_gemma4_vocabulary_rebuilt_gives_the_source_ids(tmp_path: Path) -> None:
    """Gemma 4's tokenizer as its releases build it (spaces as ``▁``, no prefix, byte
    fallback): every text's ids, and no ``▁`` before the first word."""
    from tokenizers import Tokenizer

    src = FIXTURES / "hf" / "gemma4-text"
    back, notes = read_back(src, tmp_path, None)
    assert notes == []
    assert_same_ids(src, back, texts(), split=False)  # Gemma splits at spaces it has made ▁: no split
    tokens = Tokenizer.from_file(str(back / "tokenizer.json")).encode("Hello world", add_special_tokens=False).tokens
    assert tokens[0] == "H" and tokens[-3:] == ["▁w", "or", "ld"]


# the release tokenizers' splits, as llama.cpp's source quotes them from their tokenizer.json
QWEN35_SPLIT = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
]
DEEPSEEK_V3_SPLIT = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# a text each split cuts otherwise than the others, and into how many pieces
TELLING = {"qwen35": ("x\u0301y\u0301", 1), "deepseek-v3": ("12345中文abc", 4)}


def with_split(src: Path, out: Path, regexes: list[str]) -> Path:
    """``src`` with its tokenizer.json splitting by ``regexes`` in turn, then byte-level."""
    shutil.copytree(src, out)
    doc = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    split = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [*split, byte_level]}
    doc["normalizer"] = None  # the releases' (the fixture's Qwen2-style NFC is not Qwen3.5's)
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.mark.parametrize(
    ("fixture", "pre", "regexes"),
    [("qwen3_5", "qwen35", QWEN35_SPLIT), ("deepseek_v3", "deepseek-v3", DEEPSEEK_V3_SPLIT)],
    ids=["qwen35", "deepseek-v3"],
)
def test_split_of_the_release_tokenizers_rebuilt(fixture: str, pre: str, regexes: list[str], tmp_path: Path) -> None:
    """Qwen3.5's (marks join letters) and DeepSeek V3's (three splits in turn) pre-tokenizers,
    around the fixture's vocabulary: the source's splits and ids."""
    from tokenizers import Tokenizer

    src = with_split(FIXTURES / "hf" / fixture, tmp_path / "src", regexes)
    back, notes = read_back(src, tmp_path, pre)
    assert [n for n in notes if "tokenizer" in n and "refuse" not in n] == []
    text, pieces = TELLING[pre]
    assert_same_ids(src, back, [*texts(), text])
    assert len(Tokenizer.from_file(str(back / "tokenizer.json")).pre_tokenizer.pre_tokenize_str(text)) == pieces


def test_a_pre_tokenizer_not_rebuilt_still_converts_with_one_note(tmp_path: Path) -> None:
    """Kimi K2's split is not one ckptkit rebuilds: the weights still come back, one note says
    the tokenizer files are missing."""
    from ckptkit.verify import verify_paths

    src = FIXTURES / "hf" / "gpt_oss"
    back, notes = read_back(src, tmp_path, "kimi-k2")
    assert verify_paths(src, back).identical == verify_paths(src, src).identical
    assert notes == [
        "byte-level BPE pre-tokenizer 'kimi-k2' is not one ckptkit rebuilds "
        "(llama-bpe, qwen2, qwen35, glm4, gpt-4o, llama4, deepseek-v3, joyai-llm): the output has none; "
        "to use the model with a tokenizer, copy the original model's tokenizer files beside it"
    ]
    assert not (back / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["qwen35", "gemma-4"])
def test_real_vocabulary_rebuilt_gives_the_official_ids(vocab: str) -> None:
    """llama.cpp's vocabulary GGUFs of Qwen3.5's split (248k-token files, tens of seconds to
    read: slow) and of Gemma 4's real vocabulary, with its test texts and the ids the original
    tokenizers give them."""
    from tokenizers import Tokenizer

    from ckptkit.formats.gguf.reader import read_header
    from ckptkit.formats.gguf.tokenizer import tokenizer_files

    from tokenizer_helpers import llama_cpp_dir, vocab_tests

    files, notes = tokenizer_files(read_header(llama_cpp_dir() / "models" / f"ggml-vocab-{vocab}.gguf"), 4096)
    assert notes == []
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    cases = vocab_tests(vocab)
    assert [tok.encode(text, add_special_tokens=False).ids for text, _ in cases] == [ids for _, ids in cases]
