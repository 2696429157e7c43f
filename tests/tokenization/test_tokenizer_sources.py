"""A tokenizer never blocks the weights, and ``--tokenizer`` supplies one.

A sentencepiece model that no ``tokenizer.json`` encodes exactly like (a normalization table
such as sentencepiece's default ``nmt_nfkc``, a unigram model) converts with its weights: the
output keeps ``tokenizer.model`` and one note says why it has no ``tokenizer.json``; GGUF reads
the model as llama.cpp's converter does. References: sentencepiece itself (its encoding, its
own ``nmt_nfkc`` table), a model from sentencepiece's own tests (not made here), the
``tokenizers`` library's ``Precompiled`` normalizer, the HF fixture's weights (written by
transformers) and GGUF read back with the ``gguf`` package.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.tokenization.spm_proto import BPE, UNIGRAM, read_spm_model, write_spm_model

from conftest import FIXTURES, tree_hashes
from tokenizer_helpers import CORPUS, sentencepiece_test_model

NFKC = FIXTURES / "meta" / "llama2-nfkc"  # meta/llama2's weights, a tokenizer trained with sentencepiece's defaults
NO_JSON = "the output has no tokenizer.json: tokenizer.model cannot be written as one exactly: "
LOAD_IT = "; to tokenize, load the output's tokenizer.model with sentencepiece"
# Texts that NFKC (and sentencepiece's whitespace handling) change: full-width letters,
# ligatures, compatibility characters, combining marks, runs and other kinds of spaces.
NFKC_TEXTS = ["Ｆｕｌｌ－ｗｉｄｔｈ Ｔｅｘｔ", "ﬁne ﬂour", "① ™ ½ ㍿ Ⅻ", "cafe\u0301", "  a    b  ", "\u3000x\u00a0y\t"]
# Where the tokenizers library's Precompiled normalizer (transformers' way of writing such a
# tokenizer.json) and sentencepiece normalize differently: half-width katakana with a sound
# mark, decomposed Hangul, an accent on a full-width letter, one on an ideographic space.
PRECOMPILED_DIFFERS = ["ﾊﾟﾝ", "\u1100\u1161", "Ａ\u0301", "\u3000\u0300"]


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}


def _weights_of_llama2(folder: Path) -> None:
    """``folder``'s tensors are the HF llama2 fixture's, bit for bit (transformers wrote those)."""
    ours, theirs = _hf_weights(folder), _hf_weights(FIXTURES / "hf" / "llama2")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8))


def test_the_fixture_has_sentencepiece_s_default_normalization() -> None:
    model = read_spm_model(NFKC / "tokenizer.model")
    table = Path(spm.__file__).parent / "package_data" / "nmt_nfkc.bin"  # sentencepiece's own nmt_nfkc table
    assert (model.normalizer_name, model.precompiled_charsmap) == ("nmt_nfkc", table.read_bytes())
    assert model.model_type == BPE and model.remove_extra_whitespaces and not model.byte_fallback
    sp = spm.SentencePieceProcessor(model_file=str(NFKC / "tokenizer.model"))
    assert sp.encode("Ｔｈｅ ﬁ") == sp.encode("The fi") != []  # normalized before it is split


def test_tokenizers_precompiled_normalizer_differs_from_sentencepiece() -> None:
    """Why a model with a normalization table gets no tokenizer.json: the tokenizers library's
    ``Precompiled`` normalizer, given the model's own table, agrees with sentencepiece on plain
    NFKC cases but not on these texts (it maps whole grapheme clusters by their first mapped
    character and composes nothing across clusters)."""
    from tokenizers.normalizers import Precompiled

    table = Precompiled(read_spm_model(NFKC / "tokenizer.model").precompiled_charsmap)
    sp = spm.SentencePieceProcessor(model_file=str(NFKC / "tokenizer.model"))

    def theirs(text: str) -> str:  # sentencepiece's, without its dummy prefix
        return sp.normalize(text).removeprefix("▁").replace("▁", " ")

    assert [table.normalize_str(t) for t in ("Ｆｕｌｌ", "ﬁne", "①")] == [theirs(t) for t in ("Ｆｕｌｌ", "ﬁne", "①")]
    assert [t for t in PRECOMPILED_DIFFERS if table.normalize_str(t) != theirs(t)] == PRECOMPILED_DIFFERS


@pytest.mark.parametrize("to", ["hf", "hf-bin"])
def test_a_model_with_a_normalization_table_converts_with_its_tokenizer_model(to: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    notes = [n for n in convert(NFKC, out, ConvertOptions(to)).notes if "tokenizer" in n]
    why = "its normalizer (nmt_nfkc) maps text by a table that tokenizer.json cannot apply as sentencepiece does"
    assert len(notes) == 1 and notes[0].startswith(NO_JSON + why) and notes[0].endswith(LOAD_IT)
    assert sorted(p.name for p in out.iterdir() if "token" in p.name) == ["tokenizer.model"]
    assert (out / "tokenizer.model").read_bytes() == (NFKC / "tokenizer.model").read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(NFKC / "tokenizer.model"))
    config, generation = (json.loads((out / n).read_text()) for n in ("config.json", "generation_config.json"))
    assert config["bos_token_id"] == generation["bos_token_id"] == sp.bos_id()
    assert config["eos_token_id"] == generation["eos_token_id"] == sp.eos_id()
    if to == "hf":
        _weights_of_llama2(out)
        convert(out, tmp_path / "meta", ConvertOptions("meta"))  # and back: Meta's folder as it was
        assert tree_hashes(tmp_path / "meta") == tree_hashes(NFKC)


def test_a_model_with_a_normalization_table_converts_on_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptkit.cli import app

    res = CliRunner().invoke(app, ["convert", str(NFKC), str(tmp_path / "out"), "--to", "hf"])
    assert res.exit_code == 0, res.output
    assert res.output.count("has no tokenizer.json") == 1 and "tokenizer.model cannot be written" in res.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_unigram_model_not_made_here_converts_with_a_note(tmp_path: Path) -> None:
    """sentencepiece's own test model (unigram, nfkc, 1000 pieces) beside llama2 weights
    widened to 1000 rows: the weights convert, tokenizer.model is carried, one note says why."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "meta" / "llama2", src)
    sd = torch.load(src / "consolidated.00.pth", weights_only=True)
    for name in ("tok_embeddings.weight", "output.weight"):
        sd[name] = sd[name].repeat(3, 1)[:1000].clone()
    torch.save(sd, src / "consolidated.00.pth")
    shutil.copyfile(sentencepiece_test_model(), src / "tokenizer.model")
    assert read_spm_model(src / "tokenizer.model").model_type == UNIGRAM
    notes = [n for n in convert(src, tmp_path / "out", ConvertOptions("hf")).notes if "tokenizer" in n]
    why = "only BPE sentencepiece models can be converted (this one is a unigram model)"
    assert notes == [NO_JSON + why + LOAD_IT]
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    hf = _hf_weights(tmp_path / "out")
    assert torch.equal(hf["model.embed_tokens.weight"], sd["tok_embeddings.weight"])


def _gguf_vocab(path: Path) -> tuple[list[str], list[float], list[int]]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    return tuple(fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type"))  # type: ignore[return-value]


def _sentencepiece_types(sp: spm.SentencePieceProcessor) -> list[int]:
    """Each piece's type as sentencepiece reports it, numbered as in its model format."""
    kinds = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)]
    return [next((n for is_kind, n in kinds if is_kind(i)), 1) for i in range(sp.get_piece_size())]


@pytest.mark.parametrize("family", ["llama2-nfkc", "llama2"])
def test_gguf_takes_the_sentencepiece_model_as_llama_cpp_reads_it(family: str, tmp_path: Path) -> None:
    """With a tokenizer.json (llama2) or without one (llama2-nfkc): pieces, scores and types
    from tokenizer.model, padded to the embeddings with llama.cpp's [PADn] fillers."""
    notes = convert(FIXTURES / "meta" / family, tmp_path / "m.gguf", ConvertOptions("gguf")).notes
    tokens, scores, types = _gguf_vocab(tmp_path / "m.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(FIXTURES / "meta" / family / "tokenizer.model"))
    n = sp.get_piece_size()
    assert tokens == [sp.id_to_piece(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, 384)]
    assert scores == [sp.get_score(i) for i in range(n)] + [-10000.0] * (384 - n)
    assert types == _sentencepiece_types(sp) + [5] * (384 - n)
    # llama.cpp's sentencepiece tokenizer only escapes spaces and adds the prefix: a note says what it skips
    skipped = "tokenizer.model maps text by its nmt_nfkc table and removes extra whitespace before splitting it"
    assert [n.startswith(skipped) for n in notes if "llama.cpp" in n] == ([] if family == "llama2" else [True])


# --- sentencepiece's whitespace handling, which tokenizer.json does reproduce ----------------

WHITESPACE = st.sampled_from([" ", "  ", "   ", "\t", "\n", "\u3000", "\u00a0", "▁", "▁▁", "a", "bc", "é", "ﬁ"])
# Without the special tokens' own spellings: in text, tokenizers' added-token matcher takes
# "<unk>" as the special token and sentencepiece never does (as transformers' own
# LlamaTokenizerFast does; not the whitespace rule under test).
SPECIALS = ("<unk>", "<s>", "</s>")
TEXTS = (
    st.lists(st.one_of(st.text(max_size=5), WHITESPACE), max_size=12)
    .map("".join)
    .filter(lambda t: not any(s in t for s in SPECIALS))
)


@pytest.fixture(scope="module")
def whitespace_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The fixture's model without its table (the identity normalizer, extra whitespace still
    removed), converted: (its tokenizer.model, the tokenizer.json ckptkit wrote)."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("whitespace")
    shutil.copytree(NFKC, root / "src")
    model = read_spm_model(NFKC / "tokenizer.model")
    model.normalizer_name, model.precompiled_charsmap = "identity", b""
    (root / "src" / "tokenizer.model").write_bytes(write_spm_model(model))
    convert(root / "src", root / "hf", ConvertOptions("hf"))
    return root / "src" / "tokenizer.model", Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))


def test_extra_whitespace_is_removed_as_sentencepiece_does(whitespace_model: tuple[Path, object]) -> None:
    path, fast = whitespace_model
    sp = spm.SentencePieceProcessor(model_file=str(path))
    texts = [*CORPUS, *NFKC_TEXTS, "▁", " ▁ ", "a▁▁", "▁a ▁", "  \u3000  "]
    assert [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)] == [sp.encode(t) for t in texts]
    assert sp.encode("  a    b  ") == sp.encode("a b")  # the setting is in force


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_extra_whitespace_is_removed_as_sentencepiece_does_on_generated_text(
    whitespace_model: tuple[Path, object], text: str
) -> None:
    path, fast = whitespace_model
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert fast.encode(text, add_special_tokens=False).ids == sp.encode(text)  # type: ignore[attr-defined]


# --- --tokenizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["meta/llama2", "meta/llama2/tokenizer.model", "hf/llama2"])
def test_tokenizer_option_gives_a_dcp_checkpoint_its_tokenizer(given: str, tmp_path: Path) -> None:
    """The trainer's DCP folder has no tokenizer: --tokenizer names one (a Meta folder, the
    file, an HF folder); the GGUF holds its vocabulary, and the HF folder its files."""
    convert(FIXTURES / "dcp" / "llama2", tmp_path / "m.gguf", ConvertOptions("gguf", tokenizer=FIXTURES / given))
    convert(FIXTURES / "dcp" / "llama2", tmp_path / "hf", ConvertOptions("hf", tokenizer=FIXTURES / given))
    sp = spm.SentencePieceProcessor(model_file=str(FIXTURES / "meta" / "llama2" / "tokenizer.model"))
    tokens, _, _ = _gguf_vocab(tmp_path / "m.gguf")
    assert tokens == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.model").read_bytes() == (FIXTURES / "meta" / "llama2" / "tokenizer.model").read_bytes()
    if given == "hf/llama2":  # an HF folder's files, carried as they are
        assert (hf / "tokenizer.json").read_bytes() == (FIXTURES / given / "tokenizer.json").read_bytes()
    else:  # converted from tokenizer.model
        assert json.loads((hf / "tokenizer_config.json").read_text())["bos_token"] == "<s>"
    assert sorted(FIXTURES.joinpath("dcp", "llama2").rglob("token*")) == []  # the source is left as it was


def test_tokenizer_option_replaces_the_source_s_tokenizer(tmp_path: Path) -> None:
    """Given to a source with a tokenizer, --tokenizer's files stand in for its own."""
    result = convert(
        FIXTURES / "meta" / "llama2", tmp_path / "out", ConvertOptions("hf", tokenizer=NFKC / "tokenizer.model")
    )
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (NFKC / "tokenizer.model").read_bytes()
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert any(n.startswith(NO_JSON) for n in result.notes)


def test_tokenizer_option_errors_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in [
        (tmp_path / "absent", f"--tokenizer {tmp_path / 'absent'}: no such file or folder"),
        (empty, f"--tokenizer {empty}: the folder has no tokenizer.model or tokenizer.json"),
    ]:
        with pytest.raises(CkptkitError) as err:
            convert(FIXTURES / "dcp" / "llama2", tmp_path / "m.gguf", ConvertOptions("gguf", tokenizer=path))
        assert str(err.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
