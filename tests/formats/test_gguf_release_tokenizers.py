"""Real release tokenizers in ckptkit's GGUF: the pre-tokenizer name llama.cpp's converter
gives the tokenizer files, measured on them. Llama 4: Meta's tiktoken rank file and
``pat_str`` (the llama-models wheel) built into a ``tokenizer.json`` by the tokenizers
library (:func:`~ckptkit.tokenization.tiktoken_bpe.build_tokenizer`), whose ids are Meta's
on llama.cpp's tokenizer test texts. gpt-oss: tiktoken's ``o200k_harmony`` over OpenAI's
o200k_base rank file, built the same way. DeepSeek V3: its ``tokenizer.json``. (Both from
the litellm wheel's data files. GLM-4.5's files are not shipped by any package the tests may
fetch: its split is tested around the fixture's vocabulary, tests/formats/test_gguf_vocab_rebuild.py.)"""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path

import pytest
from test_gguf_pre import llama_cpp_pre_tokenizers

from ckptkit.formats.gguf.vocab import CHKTXT, pre_tokenizer, same_split
from ckptkit.tokenization.tiktoken_bpe import build_tokenizer, read_ranks

from tokenizer_helpers import litellm_tokenizers, llama4_meta_tokenizer, vocab_tests


@pytest.mark.slow
def test_llama4_release_tokenizer_is_llama_cpp_s_llama4(llama_cpp: Path, tmp_path: Path) -> None:
    """Its ids are Meta's; llama.cpp's converter and ckptkit's GGUF writer name it ``llama4``
    (the name from the hash of the probe text's ids, the ``tokenizer.ggml.pre`` from
    :func:`~ckptkit.formats.gguf.vocab.pre_tokenizer`, which the writer asks: the whole
    ``add_vocab`` of 202k tokens takes half a minute), and its split is the rule ckptkit
    rebuilds ``llama4`` tokenizers with."""
    meta, rank_file = llama4_meta_tokenizer()
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    tok = build_tokenizer(read_ranks(rank_file), specials, "<|begin_of_text|>", meta.model._pat_str)
    texts = [text for text, _ in vocab_tests("llama-bpe")]  # llama.cpp's tokenizer test texts
    ids = [meta.encode(t, bos=False, eos=False) for t in texts]
    assert [tok.encode(t, add_special_tokens=False).ids for t in texts] == ids
    probe = tok.encode(CHKTXT).ids  # as llama.cpp's converter encodes it (BOS added)
    assert probe == meta.encode(CHKTXT, bos=True, eos=False)
    named = llama_cpp_pre_tokenizers(llama_cpp).get(sha256(str(probe).encode()).hexdigest())
    tok.save(str(tmp_path / "tokenizer.json"))
    notes: list[str] = []
    ours = pre_tokenizer(tmp_path / "tokenizer.json", probe, None, notes)
    assert (named, ours, notes) == ("llama4", "llama4", [])
    assert same_split(tmp_path / "tokenizer.json", "llama4")


@pytest.mark.slow
def test_gpt_oss_release_tokenizer_is_llama_cpp_s_gpt_4o(
    llama_cpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's ``o200k_harmony`` (tiktoken's own definition, over OpenAI's o200k_base rank
    file from the litellm wheel) built into a ``tokenizer.json`` as the release's is: its ids
    are tiktoken's; llama.cpp's converter and ckptkit's GGUF writer name it ``gpt-4o``, and its
    split is the rule ckptkit rebuilds ``gpt-4o`` tokenizers with."""
    import tiktoken

    ranks_file = litellm_tokenizers()["o200k_base"]
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(ranks_file.parent))  # tiktoken checks its sha256 too
    harmony = tiktoken.get_encoding("o200k_harmony")
    by_id: dict[int, str] = {}  # 200018 has two names: the release's tokenizer.json keeps <|endofprompt|>
    for name, i in sorted(harmony._special_tokens.items(), key=lambda s: (s[1], s[0].startswith("<|reserved_"))):
        by_id.setdefault(i, name)
    ranks = read_ranks(ranks_file)
    assert sorted(by_id) == list(range(len(ranks), harmony.n_vocab))
    tok = build_tokenizer(ranks, [by_id[i] for i in sorted(by_id)], None, harmony._pat_str)
    texts = [text for text, _ in vocab_tests("llama-bpe")]  # llama.cpp's tokenizer test texts
    ids = [harmony.encode(t, allowed_special="all") for t in texts]
    assert [tok.encode(t, add_special_tokens=False).ids for t in texts] == ids
    probe = tok.encode(CHKTXT).ids  # as llama.cpp's converter encodes it (no BOS in gpt-oss's)
    assert probe == harmony.encode(CHKTXT)
    named = llama_cpp_pre_tokenizers(llama_cpp).get(sha256(str(probe).encode()).hexdigest())
    tok.save(str(tmp_path / "tokenizer.json"))
    notes: list[str] = []
    ours = pre_tokenizer(tmp_path / "tokenizer.json", probe, None, notes)
    assert (named, ours, notes) == ("gpt-4o", "gpt-4o", [])
    assert same_split(tmp_path / "tokenizer.json", "gpt-4o")


@pytest.mark.slow
def test_deepseek_v3_release_tokenizer_is_llama_cpp_s_joyai_llm_or_deepseek_v3(llama_cpp: Path, tmp_path: Path) -> None:
    """DeepSeek V3's ``tokenizer.json`` (the litellm wheel's copy). Its own post-processor adds
    no BOS, nor does ``AutoTokenizer`` (transformers 5), which llama.cpp's converter encodes the
    probe text with: llama.cpp's hash of those ids names ``joyai-llm``, and ckptkit's writer
    agrees. With BOS first, as the release's ``tokenizer_config.json`` (``add_bos_token``,
    ``LlamaTokenizerFast``) had transformers 4 encode, both name ``deepseek-v3``. Its split is
    ckptkit's rule for both (llama.cpp's vocabulary loader splits them alike), and the tokenizer
    ckptkit rebuilds from a GGUF it wrote of the file gives the original's ids."""
    import gguf
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from ckptkit.formats.gguf.reader import meta_str, read_header
    from ckptkit.formats.gguf.tokenizer import tokenizer_files
    from ckptkit.formats.gguf.vocab import add_vocab

    path = litellm_tokenizers()["deepseek-v3"] / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    table = llama_cpp_pre_tokenizers(llama_cpp)
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    probe = tok.encode(CHKTXT).ids
    assert (bos, probe[0] != bos) == (0, True)
    assert AutoTokenizer.from_pretrained(path.parent).encode(CHKTXT) == probe
    named = [table.get(sha256(str(ids).encode()).hexdigest()) for ids in (probe, [bos, *probe])]
    notes: list[str] = []
    ours = [pre_tokenizer(path, ids, None, notes) for ids in (probe, [bos, *probe])]
    assert (named, ours, notes) == (["joyai-llm", "deepseek-v3"], ["joyai-llm", "deepseek-v3"], [])
    assert same_split(path, "deepseek-v3") and same_split(path, "joyai-llm")
    w = gguf.GGUFWriter(tmp_path / "v.gguf", "deepseek2")
    assert add_vocab(w, "bpe", path.parent, {"vocab_size": tok.get_vocab_size()}) == []
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    header = read_header(tmp_path / "v.gguf")
    files, notes = tokenizer_files(header, None)
    assert (meta_str(header, "tokenizer.ggml.pre"), notes) == ("joyai-llm", [])
    back = Tokenizer.from_str(files["tokenizer.json"].decode())
    texts = [CHKTXT, *(text for text, _ in vocab_tests("llama-bpe"))]
    want = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert [back.encode(t, add_special_tokens=False).ids for t in texts] == want
