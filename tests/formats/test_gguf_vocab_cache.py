"""One conversion parses each tokenizer file once; a file rewritten between two conversions in
the same process is read again, not taken from what the first one parsed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf import TokenType
from gguf_sections import kv_values

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

OPTS = ConvertOptions("gguf", dtype="q8_0", gguf_pre="qwen2")  # the qwen3 fixture's tiny BPE: llama.cpp's qwen2


def _retyped(folder: Path) -> int:
    """Rewrite ``folder``'s tokenizer.json with its first added token renamed and no longer
    special (llama.cpp: a user-defined token); returns its id."""
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    first = doc["added_tokens"][0]
    first.update(content="plain_added", special=False)
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return int(first["id"])


def test_a_tokenizer_json_rewritten_between_two_conversions_is_read_again(tmp_path: Path) -> None:
    src, fresh = tmp_path / "qwen3", tmp_path / "fresh"
    shutil.copytree(FIXTURES / "hf" / "qwen3", src)
    convert(src, tmp_path / "before.gguf", OPTS)
    tid = _retyped(src)
    convert(src, tmp_path / "after.gguf", OPTS)
    shutil.copytree(src, fresh)  # a path no conversion has read yet
    convert(fresh, tmp_path / "fresh.gguf", OPTS)
    before, after = kv_values(tmp_path / "before.gguf"), kv_values(tmp_path / "after.gguf")
    types, tokens = after["tokenizer.ggml.token_type"], after["tokenizer.ggml.tokens"]
    assert before["tokenizer.ggml.token_type"][tid] == TokenType.CONTROL  # type: ignore[index]
    assert (tokens[tid], types[tid]) == ("plain_added", TokenType.USER_DEFINED)  # type: ignore[index]
    assert {k: v for k, v in after.items() if k != "general.name"} == {
        k: v for k, v in kv_values(tmp_path / "fresh.gguf").items() if k != "general.name"
    }


def test_one_conversion_parses_tokenizer_json_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptkit.formats.base as base

    parsed: list[str] = []
    loads = base.loads_json

    def counted(text: str | bytes, where: Path, *args: object, **kwargs: object) -> object:
        parsed.append(where.name)
        return loads(text, where, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(base, "loads_json", counted)
    src = tmp_path / "qwen3"
    shutil.copytree(FIXTURES / "hf" / "qwen3", src)
    convert(src, tmp_path / "a.gguf", OPTS)
    assert parsed.count("tokenizer.json") == 1, parsed


def test_a_sentencepiece_style_tokenizer_json_alone_is_refused_in_one_line(tmp_path: Path) -> None:
    """gguf's LlamaHfVocab would take Llama 2's tokenizer.json (byte fallback, a Sequence decoder):
    without its tokenizer.model ckptkit refuses it rather than write it as byte-level BPE."""
    src = tmp_path / "llama2"
    shutil.copytree(FIXTURES / "hf" / "llama2", src)
    (src / "tokenizer.model").unlink()
    doc = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    assert doc["model"]["byte_fallback"] and doc["decoder"]["type"] == "Sequence"
    with pytest.raises(CkptkitError, match="sentencepiece-style tokenizer.json without tokenizer.model"):
        convert(src, tmp_path / "a.gguf", ConvertOptions("gguf", dtype="q8_0"))
