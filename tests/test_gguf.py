"""GGUF written by ckptkit equals what llama.cpp's own converter writes for the same model.

The reference is ``convert_hf_to_gguf.py`` from the llama-cpp-python sdist (the
``llama_cpp`` fixture), run on the HF folder; both files are read back with the ``gguf``
package's GGUFReader and compared: key/value metadata (names, order, types, values; the
free-text naming keys aside) and tensors (names, order, GGML types, shapes, bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptkit.convert import convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES
from tokenizer_helpers import write_tiny_meta_llama3

OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0", None: "auto"}
NAMING = ("general.name", "general.size_label", "general.basename", "general.finetune", "general.version")


# llama.cpp's converter, with a byte-level BPE tokenizer it does not recognise by hash read as
# the pre-tokenizer named first on the command line (the fixtures' tiny trained vocabularies)
UNKNOWN_PRE_AS = """
import runpy, sys
pre = sys.argv.pop(1)
sys.path.insert(0, ".")
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_gguf(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str, unknown_pre: str | None = None) -> Path:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    cmd = [sys.executable, "convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    if unknown_pre is not None:
        cmd[1:2] = ["-c", UNKNOWN_PRE_AS, unknown_pre]
    res = subprocess.run(cmd, cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def contents(path: Path) -> tuple[list[tuple[str, list[int], Any]], list[tuple[str, str, list[int], bytes]]]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    kv = [
        (k, [int(t) for t in f.types], f.contents())
        for k, f in r.fields.items()
        if not k.startswith("GGUF.") and k not in NAMING
    ]
    tensors = [(t.name, t.tensor_type.name, [int(x) for x in t.shape], t.data.tobytes()) for t in r.tensors]
    return kv, tensors


def assert_same_gguf(ours: Path, theirs: Path) -> None:
    (kv_a, t_a), (kv_b, t_b) = contents(ours), contents(theirs)
    assert [k for k, _, _ in kv_a] == [k for k, _, _ in kv_b]
    for a, b in zip(kv_a, kv_b, strict=True):
        assert a == b, a[0]
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b]
    for a, b in zip(t_a, t_b, strict=True):
        assert a[3] == b[3], f"{a[0]}: bytes differ"


# The newer families differ from the older ones in keys, names, transforms and vocabularies,
# not in how an outtype picks GGML types: q8_0 once here (odd row lengths fall back to F16);
# their auto outputs are compared where they are also read back (test_gguf_read.py).
HF_CASES = [(f, d) for f in ("llama2", "mistral", "gemma", "phi3") for d in OUTTYPES] + [("qwen3", "q8_0")]
# The fixtures' byte-level BPE tokenizers are tiny trained ones, whose probe-text hash llama.cpp
# cannot know: both converters are told which pre-tokenizer they use (Qwen2's, Llama 3's).
TINY_BPE = {"qwen3": "qwen2", "olmo2": "llama-bpe"}


class UnknownHashMeans(dict[str, str]):
    """ckptkit's table of pre-tokenizer hashes, reading an unknown hash as ``pre``."""

    def __init__(self, known: dict[str, str], pre: str) -> None:
        super().__init__(known)
        self.pre = pre

    def get(self, key: str, default: object = None) -> str:  # type: ignore[override]
        return super().get(key, self.pre)


def tiny_bpe_as(monkeypatch: pytest.MonkeyPatch, family: str) -> str | None:
    from ckptkit.formats.gguf import vocab

    pre = TINY_BPE.get(family)
    if pre is not None:
        monkeypatch.setattr(vocab, "PRE_TOKENIZERS", UnknownHashMeans(vocab.PRE_TOKENIZERS, pre))
    return pre


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), HF_CASES)
def test_hf_to_gguf_equals_llama_cpp(
    family: str, dtype: str | None, llama_cpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = FIXTURES / "hf" / family
    pre = tiny_bpe_as(monkeypatch, family)
    # llama.cpp's casts are lossy (a weight under float16's range becomes 0): so are ours, asked to be
    convert(src, tmp_path / "ours.gguf", "gguf", dtype=dtype, allow_lossy_cast=dtype is not None)
    theirs = llama_cpp_gguf(llama_cpp, src, tmp_path / "theirs.gguf", OUTTYPES[dtype], pre)
    assert_same_gguf(tmp_path / "ours.gguf", theirs)


# Llama 3.1's real tokenizer takes llama.cpp most of a minute: its vocabulary does not depend
# on the outtype, so two outtypes (auto and q8_0) cover it; the small families take all five.
META_CASES = [(f, d) for f in ("llama2", "mistral") for d in OUTTYPES] + [
    ("llama3_1-real-tokenizer", d) for d in (None, "q8_0")
]
# Families with no Meta layout come from ckptkit's internal format (Gemma 3's rope bases per
# layer type, soft-capping, sliding window)
META_CASES += [("internal:gemma3_text", None)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), META_CASES)
def test_meta_to_gguf_directly_equals_llama_cpp_on_the_hf_copy(
    family: str, dtype: str | None, llama_cpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Meta ranks go to GGUF with no HF step, as llama.cpp converts the HF folder ckptkit writes
    (Llama 3.1: Meta's real tokenizer, the Llama 3 pre-tokenizer hash, the rope_freqs tensor);
    that HF folder, as an HF source, gives the same file. Internal checkpoints too, against the
    HF folder ``--to hf`` restores from them."""
    pre = None
    if family.startswith("llama3_1"):
        src = tmp_path / "meta"
        write_tiny_meta_llama3(src)
    elif family.startswith("internal:"):
        family = family.removeprefix("internal:")
        src = tmp_path / "internal"
        convert(FIXTURES / "hf" / family, src, "internal")
        pre = tiny_bpe_as(monkeypatch, family)
    else:
        src = FIXTURES / "meta" / family
    convert(src, tmp_path / "ours.gguf", "gguf", dtype=dtype, allow_lossy_cast=dtype is not None)
    convert(src, tmp_path / "hf", "hf")
    theirs = llama_cpp_gguf(llama_cpp, tmp_path / "hf", tmp_path / "theirs.gguf", OUTTYPES[dtype], pre)
    assert_same_gguf(tmp_path / "ours.gguf", theirs)
    if dtype is None or not family.startswith("llama3_1"):  # the real vocabulary once (it takes a while)
        convert(tmp_path / "hf", tmp_path / "from-hf.gguf", "gguf", dtype=dtype, allow_lossy_cast=dtype is not None)
        assert_same_gguf(tmp_path / "from-hf.gguf", theirs)


@pytest.mark.slow
def test_internal_and_dcp_copies_give_llama_cpp_s_gguf_of_the_hf_folder_they_came_from(
    llama_cpp: Path, tmp_path: Path
) -> None:
    """Their tensor order (shard by shard) and config.json (max_position_embeddings, which
    params.json cannot hold) are those of the recorded HF folder, as llama.cpp would read it."""
    src = FIXTURES / "hf" / "llama2"
    theirs = llama_cpp_gguf(llama_cpp, src, tmp_path / "theirs.gguf", "auto")
    for fmt in ("internal", "dcp"):
        convert(src, tmp_path / fmt, fmt)
        convert(tmp_path / fmt, tmp_path / f"{fmt}.gguf", "gguf")
        assert_same_gguf(tmp_path / f"{fmt}.gguf", theirs)


def test_two_meta_ranks_give_the_gguf_of_one(tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / "llama2-2rank", tmp_path / "two.gguf", "gguf", dtype="q8_0")
    convert(FIXTURES / "meta" / "llama2", tmp_path / "one.gguf", "gguf", dtype="q8_0")
    a, b = contents(tmp_path / "two.gguf"), contents(tmp_path / "one.gguf")
    assert a == b


def test_q8_0_bytes_are_the_gguf_package_quantization_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from ckptkit.formats.gguf import quants as fmt

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 64 * 4 * 3)  # three rows at a time
    t = torch.randn(17, 64, generator=torch.Generator().manual_seed(0)) * 3
    t[4] = 0  # d = 0
    whole = quants.quantize(t.numpy(), GGMLQuantizationType.Q8_0).tobytes()
    assert b"".join(fmt.quantized_chunks(t, GGMLQuantizationType.Q8_0)) == whole
    assert len(whole) == 17 * 2 * 34
    assert np.frombuffer(whole[:2], np.float16)[0] == np.float16(t[0, :32].abs().max().item() / 127)


def test_gguf_output_is_published_atomically_and_refuses_to_overwrite(tmp_path: Path) -> None:
    dst = tmp_path / "out" / "model.gguf"
    convert(FIXTURES / "hf" / "llama2", dst, "gguf")
    before = dst.read_bytes()
    with pytest.raises(CkptkitError, match="exists"):
        convert(FIXTURES / "hf" / "llama2", dst, "gguf", dtype="q8_0")
    assert dst.read_bytes() == before
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.gguf"]
    convert(FIXTURES / "hf" / "llama2", dst, "gguf", dtype="q8_0", force=True)
    assert dst.read_bytes() != before


def test_q8_0_is_refused_for_other_targets(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match="--dtype q8_0 applies only to --to gguf"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "x", "hf", dtype="q8_0")
    assert not (tmp_path / "x").exists()


def test_gguf_destination_must_end_in_gguf(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match=r"ending in \.gguf"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "model.bin", "gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["hf/llama2", "meta/llama2"])
def test_a_source_without_tokenizer_is_named_in_one_line(family: str, tmp_path: Path) -> None:
    """A Meta source goes through a temporary HF folder: the error still names the source."""
    src = tmp_path / "no-tokenizer"
    src.mkdir()
    for f in (FIXTURES / family).iterdir():
        if not f.name.startswith("tokenizer"):
            (src / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CkptkitError) as err:
        convert(src, tmp_path / "out.gguf", "gguf")
    assert str(err.value) == f"{src}: no tokenizer.json or tokenizer.model; llama.cpp needs a tokenizer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tokenizer"]


@pytest.mark.parametrize("qtype", ["BF16", "F16", "F32", "Q8_0"])
def test_a_bfloat16_tensor_gives_the_gguf_package_bytes_of_its_float32_cast(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every one of the 65536 bfloat16 bit patterns (NaNs, infinities, subnormals), cast a
    chunk at a time (BF16: its own bytes, NaNs quieted) against the gguf package's
    quantization of the whole float32 cast, as llama.cpp does it."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from ckptkit.formats.gguf import quants as fmt

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256 * 4 * 5)  # five rows at a time
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16).reshape(256, 256)
    t = torch.from_numpy(bits).view(torch.bfloat16)
    if qtype == "Q8_0":
        t = torch.where(t.isfinite(), t, torch.zeros((), dtype=torch.bfloat16))  # NaN/inf blocks: numpy warns
    kind = GGMLQuantizationType[qtype]
    with np.errstate(all="ignore"):
        whole = quants.quantize(t.to(torch.float32).numpy(), kind).tobytes()
        assert b"".join(fmt.quantized_chunks(t, kind)) == whole


def test_gemma3_bpe_tokenizer_shorter_than_its_embeddings_is_refused(tmp_path: Path) -> None:
    """llama.cpp's Gemma3Model drops the embedding rows past a tokenizer.json's tokens when
    there is no tokenizer.model: a GGUF that could not come back whole, so refused."""
    src = tmp_path / "gemma3"
    shutil.copytree(FIXTURES / "hf" / "gemma3_text", src, ignore=shutil.ignore_patterns("tokenizer.model"))
    doc = json.loads((src / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    doc["model"]["vocab"] = dict(list(vocab.items())[:300])
    doc["model"]["merges"] = []
    (src / "tokenizer.json").write_text(json.dumps(doc))
    n = 300 + len(doc["added_tokens"])
    with pytest.raises(CkptkitError, match=f"keeps only the first {n} of the 384 embedding rows"):
        convert(src, tmp_path / "g.gguf", "gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma3"]


def test_gemma_settings_a_gguf_cannot_hold_are_noted_when_llama_cpp_would_run_others(tmp_path: Path) -> None:
    """Gemma 2 / 3 GGUFs have no key for query_pre_attn_scalar or layer_types: llama.cpp
    scales queries by head_dim (12 here) and makes every 2nd / 6th layer global. The
    fixtures' 16 and [sliding, full, sliding] are noted where they differ."""
    notes = {}
    for family in ("gemma2", "gemma3_text"):
        result = convert(FIXTURES / "hf" / family, tmp_path / f"{family}.gguf", "gguf")
        notes[family] = [n for n in result.notes if "GGUF has no key for" in n]
    assert len(notes["gemma2"]) == 1 and "query_pre_attn_scalar 16 (llama.cpp assumes 12)" in notes["gemma2"][0]
    assert "layer_types" not in notes["gemma2"][0]  # its layers already alternate as llama.cpp's do
    assert len(notes["gemma3_text"]) == 1 and "query_pre_attn_scalar 16" in notes["gemma3_text"][0]
    assert (
        "(llama.cpp assumes ['sliding_attention', 'sliding_attention', 'sliding_attention'])" in notes["gemma3_text"][0]
    )
