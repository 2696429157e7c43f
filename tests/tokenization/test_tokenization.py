"""Tokenizers convert with the weights: Meta tokenizer.model <-> HF tokenizer files.

References are Meta's own tokenizers (llama_models' tiktoken tokenizer and chat format,
sentencepiece itself) and transformers' AutoTokenizer loading the converted folder in an
interpreter where tiktoken, protobuf and sentencepiece cannot be imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES, tree_hashes
from tokenizer_helpers import (
    CHAT,
    CORPUS,
    LLAMA3_SPECIAL_TEXTS,
    autotokenizer_without_extras,
    llama3_tokenizer_model,
    write_tiny_meta_llama3,
)

SPM_FAMILIES = ("llama2", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Spaces where sentencepiece's remove_extra_whitespaces drops or merges them, and other whitespace it keeps.
WHITESPACE_TEXTS = ["  a   b  ", " ", "   ", "a ", " a", "a\t \tb", "\n  \n", "x \u3000 y", "▁ ▁", "a\u00a0 b"]


@pytest.fixture(scope="session")
def llama3_meta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama3") / "meta"
    write_tiny_meta_llama3(root)
    return root


@pytest.fixture(scope="session")
def llama3_hf(llama3_meta: Path) -> Path:
    out = llama3_meta.parent / "hf"
    convert(llama3_meta, out, ConvertOptions("hf"))
    return out


@pytest.fixture(scope="session")
def spm_hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Meta Llama 2 and Mistral fixtures (sentencepiece) converted to HF."""
    root = tmp_path_factory.mktemp("spm")
    for family in SPM_FAMILIES:
        convert(FIXTURES / "meta" / family, root / family, ConvertOptions("hf"))
    return {family: root / family for family in SPM_FAMILIES}


@pytest.fixture(scope="session")
def loaded(llama3_hf: Path, spm_hf: dict[str, Path]) -> dict[str, dict]:
    """What AutoTokenizer makes of each converted folder, without tiktoken/protobuf/sentencepiece."""
    jobs = [(llama3_hf, CORPUS + LLAMA3_SPECIAL_TEXTS, CHAT)] + [(spm_hf[f], CORPUS, None) for f in SPM_FAMILIES]
    results = autotokenizer_without_extras(jobs)
    return dict(zip(["llama3_1", *SPM_FAMILIES], results, strict=True))


def test_llama3_meta_to_hf_loads_without_tiktoken_and_encodes_like_meta(llama3_hf: Path, loaded: dict) -> None:
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    names = sorted(p.name for p in llama3_hf.iterdir() if not p.name.startswith(("model", "ckptkit")))
    assert names == ["config.json", *sorted(TOKENIZER_FILES)]  # no tiktoken file in the HF folder
    meta = Tokenizer(llama3_tokenizer_model())
    texts = CORPUS + LLAMA3_SPECIAL_TEXTS
    got = loaded["llama3_1"]
    assert got["ids"] == [meta.encode(t, bos=True, eos=False, allowed_special="all") for t in texts]
    assert (got["bos"], got["eos"]) == (meta.bos_id, meta.eos_id)
    dialog = [RawMessage(role=m["role"], content=m["content"]) for m in CHAT]
    assert got["chat"] == ChatFormat(meta).encode_dialog_prompt(dialog).tokens
    # All 256 specials at Meta's ids, every one a single special token.
    added = {t["content"]: t["id"] for t in json.loads((llama3_hf / "tokenizer.json").read_text())["added_tokens"]}
    assert added == meta.special_tokens
    config = json.loads((llama3_hf / "config.json").read_text())
    generation = json.loads((llama3_hf / "generation_config.json").read_text())
    assert config["bos_token_id"] == generation["bos_token_id"] == meta.bos_id
    assert config["eos_token_id"] == generation["eos_token_id"] == meta.stop_tokens


def test_llama3_meta_hf_meta_restores_tokenizer_model(llama3_hf: Path, tmp_path: Path) -> None:
    convert(llama3_hf, tmp_path / "meta", ConvertOptions("meta"))
    assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == llama3_tokenizer_model().read_bytes()
    assert not any((tmp_path / "meta" / name).exists() for name in TOKENIZER_FILES)
    convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))  # HF -> Meta -> HF: the HF files byte for byte
    for name in TOKENIZER_FILES:
        assert (tmp_path / "hf" / name).read_bytes() == (llama3_hf / name).read_bytes(), name


def test_llama3_rank_file_is_rebuilt_when_no_record_is_left(llama3_hf: Path, tmp_path: Path) -> None:
    """An HF folder that never was Meta (no origin record): tokenizer.model from tokenizer.json alone."""
    src = tmp_path / "plain-hf"
    shutil.copytree(llama3_hf, src)
    (src / "ckptkit-origin.json").unlink(missing_ok=True)
    convert(src, tmp_path / "meta", ConvertOptions("meta"))
    assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == llama3_tokenizer_model().read_bytes()


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_sentencepiece_meta_to_hf_encodes_like_sentencepiece(
    family: str, spm_hf: dict[str, Path], loaded: dict, tmp_path: Path
) -> None:
    src, out = FIXTURES / "meta" / family, spm_hf[family]
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()  # kept, as HF repos do
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    got = loaded[family]
    assert got["ids"] == [[sp.bos_id(), *sp.encode(t)] for t in CORPUS]  # add_bos, like Meta's generation code
    assert (got["bos"], got["eos"]) == (sp.bos_id(), sp.eos_id())
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["bos_token_id"] == generation["bos_token_id"] == sp.bos_id()
    assert config["eos_token_id"] == generation["eos_token_id"] == sp.eos_id()
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is False
    assert {tok_config[k] for k in ("bos_token", "eos_token", "unk_token")} == {"<s>", "</s>", "<unk>"}
    # Meta -> HF -> Meta: the sentencepiece model comes back as it was.
    convert(out, tmp_path / "meta", ConvertOptions("meta"))
    assert tree_hashes(tmp_path / "meta")["tokenizer.model"] == tree_hashes(src)["tokenizer.model"]


def test_llama2_tokenizer_beside_the_model_folder_is_used(tmp_path: Path) -> None:
    """Meta's Llama 2 downloads keep tokenizer.model one level above the weights."""
    shutil.copytree(FIXTURES / "meta" / "llama2", tmp_path / "llama-2-7b")
    (tmp_path / "llama-2-7b" / "tokenizer.model").rename(tmp_path / "tokenizer.model")
    convert(tmp_path / "llama-2-7b", tmp_path / "hf", ConvertOptions("hf"))
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (tmp_path / "tokenizer.model").read_bytes()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_llama3_0_uses_the_llama3_special_list(tmp_path: Path) -> None:
    """Llama 3 (not 3.1) names its specials differently; ids of the shared ones agree with Meta's."""
    from ckptkit.models.llama import LLAMA3_TOKENIZER
    from ckptkit.tokenization.hf_files import build_hf_tokenizer

    hf = build_hf_tokenizer(LLAMA3_TOKENIZER, llama3_tokenizer_model(), 128256, 8192)
    added = {t["content"]: t["id"] for t in json.loads(hf.files["tokenizer.json"])["added_tokens"]}
    assert len(added) == 256 and set(added.values()) == set(range(128000, 128256))
    expected = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006}
    expected.update({"<|end_header_id|>": 128007, "<|eot_id|>": 128009, "<|reserved_special_token_250|>": 128255})
    assert {k: added[k] for k in expected} == expected
    assert "<|eom_id|>" not in added and "<|python_tag|>" not in added
    assert json.loads(hf.files["generation_config.json"])["eos_token_id"] == [128001, 128009]


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"not a tokenizer at all\n", "not a sentencepiece model"), (b"IQ== 0\nIg== 5\n", "ranks are not")],
)
def test_bad_tokenizer_model_is_one_line_error(content: bytes, message: str, tmp_path: Path) -> None:
    family = "llama2" if b"IQ" not in content else "llama3"
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "meta" / family, src)
    (src / "tokenizer.model").write_bytes(content)
    before = tree_hashes(src)
    with pytest.raises(CkptkitError) as err:
        convert(src, tmp_path / "out", ConvertOptions("hf"))
    assert message in str(err.value) and str(src / "tokenizer.model") in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and tree_hashes(src) == before


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".index.json")
BOOKKEEPING = ("ckptkit-origin.json", "ckptkit.json")


def _carried(root: Path) -> dict[str, str]:
    """Every file of ``root`` but the weights and ckptkit's own records: name -> sha256."""
    return {k: v for k, v in tree_hashes(root).items() if not k.endswith(WEIGHT_SUFFIXES) and k not in BOOKKEEPING}


def _hf_sources(tmp_path: Path) -> list[Path]:
    """The bundled HF folders, and variants as older or partial repos ship them: no
    tokenizer.json (only tokenizer.model and its config), no tokenizer files at all, and a
    stray tokenizer.model one level up."""
    sources = sorted(p for fmt in ("hf", "hf-bin") for p in (FIXTURES / fmt).iterdir())
    for family, drop in (("llama2", ("tokenizer.json",)), ("mistral", ("tokenizer.json", "tokenizer_config.json"))):
        src = tmp_path / f"{family}-no-json"
        shutil.copytree(FIXTURES / "hf" / family, src)
        for name in drop:
            (src / name).unlink()
        sources.append(src)
    bare = tmp_path / "llama3-bare"
    shutil.copytree(FIXTURES / "hf" / "llama3_1", bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (bare / name).unlink()
    sources.append(bare)
    nested = tmp_path / "stray" / "llama2"
    shutil.copytree(FIXTURES / "hf" / "llama2", nested)
    (nested / "tokenizer.json").unlink()
    shutil.copy(FIXTURES / "meta" / "llama2" / "tokenizer.model", nested.parent / "tokenizer.model")
    sources.append(nested)
    return sources


def test_same_format_conversions_carry_every_file_and_add_none(tmp_path: Path) -> None:
    """HF -> HF / hf-bin / internal -> HF carry the non-weight files byte for byte and add none;
    HF -> Meta -> HF restores them; every round trip gives back the exact file set."""
    failures = []
    rounds = 0
    for src in _hf_sources(tmp_path):
        family = src.name.split("-")[0]
        back = "hf-bin" if src.parent.name == "hf-bin" else "hf"
        middles = ["hf", "hf-bin", "internal"] + (
            ["meta"] if family in ("llama2", "llama3", "llama3_1", "mistral") else []
        )
        for middle in middles:
            out = tmp_path / "out" / f"{src.parent.name}-{src.name}-{middle}"
            convert(src, out / "mid", ConvertOptions(middle))
            convert(out / "mid", out / "back", ConvertOptions(back))
            rounds += 1
            want = _carried(src)
            config = {"config.json"}  # written by each format (internal: ckptkit.json)
            if middle != "meta" and _carried(out / "mid").keys() - config != want.keys() - config:
                failures.append(f"{src} -> {middle}: {sorted(set(_carried(out / 'mid')) ^ set(want))}")
            elif middle != "meta" and any(_carried(out / "mid")[k] != v for k, v in want.items() if k not in config):
                failures.append(f"{src} -> {middle}: a carried file changed")
            got = tree_hashes(out / "back")
            names = {k for k in tree_hashes(src) if k not in BOOKKEEPING}
            if _carried(out / "back") != want or {k for k in got if k not in BOOKKEEPING} != names:
                failures.append(f"{src} -> {middle} -> {back}: {sorted(set(got) ^ set(tree_hashes(src)))}")
    assert not failures, "\n".join(failures)
    assert rounds >= 51  # every bundled HF fixture, in every middle format


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_hf_without_tokenizer_model_gets_a_sentencepiece_model_for_meta(
    family: str, spm_hf: dict[str, Path], tmp_path: Path
) -> None:
    """HF -> Meta writes tokenizer.model from a Llama-2-layout tokenizer.json when the HF
    folder has none: a sentencepiece model that encodes as the tokenizer.json does;
    converting back restores the HF folder's files exactly (and adds no tokenizer.model)."""
    from tokenizers import Tokenizer

    src = tmp_path / "hf"
    shutil.copytree(spm_hf[family], src)
    for name in ("tokenizer.model", "ckptkit-origin.json"):
        (src / name).unlink()
    convert(src, tmp_path / "meta", ConvertOptions("meta"))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "meta" / "tokenizer.model"))
    fast = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert [sp.encode(t) for t in CORPUS] == [fast.encode(t, add_special_tokens=False).ids for t in CORPUS]
    official = spm.SentencePieceProcessor(model_file=str(FIXTURES / "meta" / family / "tokenizer.model"))
    assert [sp.encode(t) for t in CORPUS] == [official.encode(t) for t in CORPUS]
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id()) == (1, 2, 0)
    convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf"))
    assert _carried(tmp_path / "back") == _carried(src)


def test_metaspace_tokenizer_json_is_not_written_as_sentencepiece(tmp_path: Path) -> None:
    """transformers 5's Metaspace layout drops sentencepiece's prefix before a leading space,
    so no sentencepiece model encodes like it: the Meta folder gets none, with a note, and
    converting back restores the HF files untouched."""
    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.tokenization import tokenizer_for_meta

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf" / "llama2", src)
    (src / "tokenizer.model").unlink()
    with open_checkpoint(src) as ckpt:
        plan = tokenizer_for_meta(src, ckpt.family.tokenizer, from_hf=True)
    assert "tokenizer.model" not in plan.files and any("tokenizer.json" in n for n in plan.notes)
    convert(src, tmp_path / "meta", ConvertOptions("meta"))
    assert not (tmp_path / "meta" / "tokenizer.model").exists()
    convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf"))
    assert _carried(tmp_path / "back") == _carried(src)


def test_tokenizer_json_with_an_unknown_pre_tokenizer_is_not_written_as_tokenizer_model(tmp_path: Path) -> None:
    """A Llama 3 tokenizer.json split by another pattern cannot be Meta's rank file: the Meta
    folder gets none (with a note), and converting back restores the file untouched."""
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf" / "llama3_1", src)
    doc = json.loads((src / "tokenizer.json").read_text())
    text = json.dumps(doc).replace("\\\\p{N}{1,3}", "\\\\p{N}{1,2}")
    assert text != json.dumps(doc)
    (src / "tokenizer.json").write_text(text)
    convert(src, tmp_path / "meta", ConvertOptions("meta"))
    assert not (tmp_path / "meta" / "tokenizer.model").exists()
    convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf"))
    assert _carried(tmp_path / "back") == _carried(src)


def test_sentencepiece_model_that_removes_extra_whitespace_encodes_like_sentencepiece(tmp_path: Path) -> None:
    """Llama 2's tokenizer with sentencepiece's default whitespace handling (leading, trailing
    and repeated spaces removed) converts, and encodes as sentencepiece does."""
    from tokenizers import Tokenizer

    from ckptkit.tokenization.spm_proto import read_spm_model, write_spm_model

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "meta" / "llama2", src)
    model = read_spm_model(src / "tokenizer.model")
    model.remove_extra_whitespaces = True
    (src / "tokenizer.model").write_bytes(write_spm_model(model))
    convert(src, tmp_path / "out", ConvertOptions("hf"))
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    fast = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    texts = [*CORPUS, *WHITESPACE_TEXTS]
    assert [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)] == [sp.encode(t) for t in texts]
    assert sp.encode("  a   b  ") == sp.encode("a b")  # the setting is in force


def test_sentencepiece_model_whose_user_defined_pieces_need_an_inexact_lookup_gets_no_tokenizer_json(
    tmp_path: Path,
) -> None:
    """User-defined pieces are written as whole-word lookups (BPE ``ignore_merges``), exact
    only when every other piece is what sentencepiece's merges make of its own text. Here
    sentencepiece makes ``a bc d`` of "abcd" (``bc`` merges first), so the weights convert
    without a tokenizer.json, and one note says why; without the user-defined piece it
    converts and encodes as sentencepiece does."""
    from tokenizers import Tokenizer

    from ckptkit.tokenization.spm_proto import BPE, CONTROL, UNKNOWN, USER_DEFINED, Piece, SpmModel, write_spm_model

    pieces = [
        Piece("<unk>", 0, UNKNOWN),
        Piece("<s>", 0, CONTROL),
        Piece("</s>", 0, CONTROL),
        Piece("[U]", 0, USER_DEFINED),
    ]
    pieces += [Piece(t, -float(i)) for i, t in enumerate(["bc", "ab", "cd", "abcd", "a", "b", "c", "d"], 1)]
    model = SpmModel(pieces, BPE, normalizer_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False)
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "meta" / "llama2", src)
    (src / "tokenizer.model").write_bytes(write_spm_model(model))
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in sp.encode("abcd")] == ["a", "bc", "d"]
    notes = convert(src, tmp_path / "no-json", ConvertOptions("hf")).notes
    assert [n for n in notes if "tokenizer" in n] == [
        "the output has no tokenizer.json: tokenizer.model cannot be written as one exactly: the piece 'abcd' "
        "is not what sentencepiece makes of its own text; to tokenize, load the output's tokenizer.model with "
        "sentencepiece"
    ]
    out = tmp_path / "no-json"
    assert sorted(_carried(out)) == ["config.json", "generation_config.json", "tokenizer.model"]
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    model.pieces.remove(pieces[3])
    (src / "tokenizer.model").write_bytes(write_spm_model(model))
    convert(src, tmp_path / "out", ConvertOptions("hf"))
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    fast = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert fast.encode("abcd", add_special_tokens=False).ids == sp.encode("abcd")
