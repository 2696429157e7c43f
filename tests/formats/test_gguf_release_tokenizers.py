"""Real release tokenizers in ckptkit's GGUF: the pre-tokenizer name llama.cpp's converter
gives the tokenizer files, measured on them. Llama 4: Meta's tiktoken rank file and
``pat_str`` (the llama-models wheel) built into a ``tokenizer.json`` by the tokenizers
library (:func:`~ckptkit.tokenization.tiktoken_bpe.build_tokenizer`), whose ids are Meta's
on llama.cpp's tokenizer test texts. (gpt-oss's ``o200k_harmony``, GLM-4.5's and DeepSeek
V3's files are not shipped by any package the tests may fetch: their splits are tested
around the fixtures' vocabularies, tests/formats/test_gguf_vocab_rebuild.py.)"""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path

import pytest
from test_gguf_pre import llama_cpp_pre_tokenizers

from ckptkit.formats.gguf.vocab import CHKTXT, pre_tokenizer, same_split
from ckptkit.tokenization.tiktoken_bpe import build_tokenizer, read_ranks

from tokenizer_helpers import llama4_meta_tokenizer, vocab_tests


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
