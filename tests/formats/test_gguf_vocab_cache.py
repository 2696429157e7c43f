"""One conversion parses each tokenizer file once and keeps nothing after it; a file rewritten
between two conversions in the same process is read again, not taken from what the first one
parsed."""

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


class _Parsed(dict):  # type: ignore[type-arg]
    """A parsed JSON object a weak reference can follow (a plain dict cannot be)."""


def test_one_conversion_parses_tokenizer_json_once_and_keeps_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside one conversion tokenizer.json is parsed once; once it returns nothing in the
    process holds that parse (a library user converting many models holds none of them)."""
    import gc
    import weakref

    import ckptkit.formats.base as base

    parsed: list[str] = []
    alive: list[weakref.ref[_Parsed]] = []
    loads = base.loads_json

    def counted(text: str | bytes, where: Path, *args: object, **kwargs: object) -> object:
        parsed.append(where.name)
        out = _Parsed(loads(text, where, *args, **kwargs))  # type: ignore[arg-type]
        if where.name == "tokenizer.json":
            alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(base, "loads_json", counted)
    src = tmp_path / "qwen3"
    shutil.copytree(FIXTURES / "hf" / "qwen3", src)
    convert(src, tmp_path / "a.gguf", OPTS)
    assert parsed.count("tokenizer.json") == 1, parsed
    gc.collect()
    assert [ref() is None for ref in alive] == [True]
    assert base._SHARED.get() is None


def test_read_json_shared_parses_once_in_a_scope_and_each_call_outside_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptkit.formats.base as base

    parsed: list[str] = []
    loads = base.loads_json

    def counted(text: str | bytes, where: Path, *args: object, **kwargs: object) -> object:
        parsed.append(where.name)
        return loads(text, where, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(base, "loads_json", counted)
    path = tmp_path / "t.json"
    path.write_text('{"a": 1}')
    assert base.read_json_shared(path) == base.read_json_shared(path) == {"a": 1}
    assert len(parsed) == 2  # no scope: nothing kept
    with base.shared_json():
        first = base.read_json_shared(path)
        with base.shared_json():  # nested: the outer scope's parses
            assert base.read_json_shared(path) is first
        assert base.read_json_shared(path) is first
        path.write_text('{"a": 2}')  # rewritten within the scope: parsed again
        assert base.read_json_shared(path) == {"a": 2}
    assert len(parsed) == 4
    assert base._SHARED.get() is None


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
