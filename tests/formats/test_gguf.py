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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_sections import kv_values, read_sections

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError, FlagError

from conftest import FIXTURES
from reference_cache import cached_outputs
from tokenizer_helpers import write_tiny_meta_llama3

OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0", None: "auto"}
NAMING = ("general.name", "general.size_label", "general.basename", "general.finetune", "general.version")


# Runs convert_hf_to_gguf.py's main once per (outfile, outtype) in one process: its start
# (torch, transformers) is most of its time. With a pre-tokenizer name, llama.cpp takes it for
# a byte-level BPE tokenizer it does not know (the fixtures' tiny BPE tokenizers); ckptkit is
# then given the same name with ``--gguf-pre`` (:func:`tiny_bpe`).
CONVERTER = """
import runpy, sys
import conversion.base as base
src, pre, *outs = sys.argv[1:]
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not pre:
            raise
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
for out, outtype in zip(outs[::2], outs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", outtype]
    runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_ggufs(llama_cpp: Path, hf_dir: Path, outs: dict[str, Path], pre: str | None = None) -> dict[str, Path]:
    """llama.cpp's GGUF of ``hf_dir`` for each outtype of ``outs`` (outtype -> file), run once
    per input (``reference_cache``)."""

    def run() -> None:
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        args = [str(hf_dir), pre or "", *[str(x) for outtype, out in outs.items() for x in (out, outtype)]]
        cmd = [sys.executable, "-c", CONVERTER, *args]
        res = subprocess.run(cmd, cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    cached_outputs([hf_dir], [CONVERTER, pre or "", *outs], list(outs.values()), run)
    return outs


def llama_cpp_gguf(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str, pre: str | None = None) -> Path:
    return llama_cpp_ggufs(llama_cpp, hf_dir, {outtype: out}, pre)[outtype]


def all_moe_qwen3(out: Path) -> dict[str, Path]:
    """The qwen3_moe fixture's config with experts in every layer (llama.cpp's qwen3moe has no
    dense layers), built by transformers (seeded, every parameter random) and saved in both
    experts layouts, with the fixture's tokenizer: layout -> HF folder."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = FIXTURES / "hf" / "qwen3_moe"
    cfg = AutoConfig.from_pretrained(src)
    cfg.mlp_only_layers = []
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    folders = {}
    for layout in ("per-expert", "stacked"):
        folders[layout] = out / layout
        model.save_pretrained(folders[layout], max_shard_size="100KB", save_original_format=layout == "per-expert")
        for f in src.glob("tokenizer*"):
            shutil.copy(f, folders[layout])
    return folders


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
    """The same key/value entries (the naming keys aside) in the same order, each the same
    bytes (key, type, value), and the same tensors (names, order, GGML types, dims, bytes);
    :func:`contents` reads either with GGUFReader, to see a difference."""
    a, b = read_sections(ours), read_sections(theirs)
    kv_a, kv_b = ([kv for kv in s.kv if kv[0] not in NAMING and not kv[0].startswith("GGUF.")] for s in (a, b))
    assert [k for k, _ in kv_a] == [k for k, _ in kv_b]
    for (key, x), (_, y) in zip(kv_a, kv_b, strict=True):
        assert x == y, f"{key}: differs"
    assert a.tensors == b.tensors
    for name, _, _ in a.tensors:
        assert a.data[name] == b.data[name], f"{name}: bytes differ"


@pytest.mark.parametrize(("family", "pre"), [("llama2", None), ("qwen2", "qwen2")])
def test_sections_split_a_gguf_as_gguf_reader_reads_it(family: str, pre: str | None, tmp_path: Path) -> None:
    """What assert_same_gguf compares: every key/value entry's bytes are its GGUFReader field's
    parts (sentencepiece and BPE vocabularies, merges), every tensor GGUFReader's; what
    kv_values decodes is every field's ``contents()``."""
    from gguf import GGUFReader

    out = tmp_path / "m.gguf"
    convert(FIXTURES / "hf" / family, out, ConvertOptions("gguf", dtype="q8_0", gguf_pre=pre))
    reader, sections = GGUFReader(out), read_sections(out)
    fields = [(k, b"".join(p.tobytes() for p in f.parts)) for k, f in reader.fields.items()]
    fields = [(k, entry) for k, entry in fields if not k.startswith("GGUF.")]
    assert sections.kv == fields and len(fields) > 20
    contents = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert kv_values(out) == contents and len(contents["tokenizer.ggml.tokens"]) > 100
    tensors = [(t.name, int(t.tensor_type), tuple(int(x) for x in t.shape)) for t in reader.tensors]
    assert sections.tensors == tensors
    assert all(sections.data[t.name] == t.data.tobytes() for t in reader.tensors)


# The fixtures' byte-level BPE tokenizers are tiny trained ones, whose probe-text hash llama.cpp
# cannot know: both converters are told which pre-tokenizer they use (Qwen2's, Llama 3's).
TINY_BPE = {"qwen3": "qwen2", "qwen3_moe": "qwen2", "olmo2": "llama-bpe"}


def tiny_bpe(family: str) -> str | None:
    """The ``--gguf-pre`` both converters are given for a fixture (None: llama.cpp needs none)."""
    return TINY_BPE.get(family.split("/")[-1].removesuffix("-stacked"))


# HF sources by fixture name (gemma2, gemma3_text and olmo2: auto, where test_gguf_read.py reads
# them back; their other outtypes take no other code); qwen3_moe: all_moe_qwen3 (both layouts). A stacked Mixtral, which
# llama.cpp's llama class cannot read (it merges experts stored one tensor each), is compared with
# what it writes for the per-expert HF copy ckptkit makes of it.
HF_SOURCES = [
    "llama2",
    "mistral",
    "gemma",
    "phi3",
    "qwen3",
    "mixtral",
    "mixtral-stacked",
    "qwen3_moe",
    "qwen3_moe-stacked",
]


@pytest.fixture(scope="module")
def hf_reference(
    llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, Path, Path, str | None]]:
    """(source, its HF folder, llama.cpp's GGUF of that for an outtype, the pre-tokenizer llama.cpp
    was told) by source name (``meta/NAME``: a Meta fixture; ``internal/NAME``: the HF fixture's
    internal copy, its HF folder the one ``--to hf`` restores): every outtype from one converter
    process per source."""
    made: dict[str, tuple[Path, Path, dict[str, Path], str | None]] = {}
    qwen3_moe: dict[str, Path] = {}

    def reference(name: str, dtype: str | None) -> tuple[Path, Path, Path, str | None]:
        if name not in made:
            tmp = tmp_path_factory.mktemp(name.replace("/", "-"))
            pre = tiny_bpe(name)
            if name.startswith("qwen3_moe"):
                qwen3_moe.update(qwen3_moe or all_moe_qwen3(tmp_path_factory.mktemp("qwen3_moe")))
                src = ref = qwen3_moe["stacked" if name.endswith("-stacked") else "per-expert"]
            elif name.startswith("meta/"):  # Meta's ranks: the HF folder ckptkit writes
                src, ref = FIXTURES / name, tmp / "hf"
                convert(src, ref, ConvertOptions("hf"))
            elif name.startswith("internal/"):
                src, ref = tmp / "internal", tmp / "hf"
                convert(FIXTURES / "hf" / name.removeprefix("internal/"), src, ConvertOptions("internal"))
                convert(src, ref, ConvertOptions("hf"))
            else:
                src = ref = FIXTURES / "hf" / name
            if name == "mixtral-stacked":
                ref = tmp / "per-expert"
                convert(src, ref, ConvertOptions("hf", experts="per-expert"))
            outs = {t: tmp / f"{t}.gguf" for t in OUTTYPES.values()}
            made[name] = (src, ref, llama_cpp_ggufs(llama_cpp, ref, outs, pre), pre)
        src, ref, refs, pre = made[name]
        return src, ref, refs[OUTTYPES[dtype]], pre

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(OUTTYPES))
@pytest.mark.parametrize("family", HF_SOURCES)
def test_hf_to_gguf_equals_llama_cpp(family: str, dtype: str | None, hf_reference: Any, tmp_path: Path) -> None:
    """Experts (both HF layouts) merged into ffn_*_exps [E, rows, cols] in llama.cpp's order, the
    router ffn_gate_inp in F32, the expert keys."""
    src, _, theirs, pre = hf_reference(family, dtype)
    # llama.cpp's casts are lossy (a weight under float16's range becomes 0): so are ours, asked to be
    lossy = dtype is not None
    convert(src, tmp_path / "ours.gguf", ConvertOptions("gguf", dtype=dtype, allow_lossy_cast=lossy, gguf_pre=pre))
    assert_same_gguf(tmp_path / "ours.gguf", theirs)


def test_dense_layers_of_a_qwen3_moe_are_refused_as_llama_cpp_has_none(tmp_path: Path) -> None:
    # llama.cpp's converter fails on this fixture too (mlp_only_layers = [1]): qwen3moe has no dense FFN
    with pytest.raises(CkptkitError, match=r"experts in every layer, but layer\(s\) 1 .* dense MLP"):
        convert(FIXTURES / "hf" / "qwen3_moe", tmp_path / "m.gguf", ConvertOptions("gguf"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_llama_cpp_s_converter_refuses_the_dense_layer_of_a_qwen3_moe_too(llama_cpp: Path, tmp_path: Path) -> None:
    """What the support matrix says of qwen3_moe (experts in every layer) is llama.cpp's rule:
    its converter fails on the fixture's first dense tensor (told the tokenizer's pre-tokenizer)."""
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    args = [str(FIXTURES / "hf" / "qwen3_moe"), "qwen2", str(tmp_path / "m.gguf"), "auto"]
    res = subprocess.run(
        [sys.executable, "-c", CONVERTER, *args], cwd=llama_cpp, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode != 0 and "Can not map tensor 'model.layers.1.mlp." in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("family", ["mixtral", "mixtral-stacked"])
def test_experts_are_read_one_merged_tensor_at_a_time(family: str) -> None:
    """Planning reads nothing; each merged tensor reads its own layer's experts of its projection,
    once each, and nothing else: the writer holds one merged tensor, never a layer or the model."""
    from ckptkit.checkpoint import open_checkpoint
    from ckptkit.formats.gguf.tensors import hf_hparams, model_tensors

    reads: list[str] = []
    with open_checkpoint(FIXTURES / "hf" / family) as ckpt:
        for name, lazy in ckpt.tensors.items():
            lazy.get = lambda get=lazy.get, name=name: reads.append(name) or get()  # type: ignore[method-assign]
        tensors, _ = model_tensors(ckpt, hf_hparams(ckpt), "q8_0")
        assert reads == []
        projection = {"gate": "w1", "up": "w3", "down": "w2"}
        for t in tensors:
            t.make()
            if "_exps." in t.name:
                layer, w = t.name.split(".")[1], projection[t.name.split(".")[2].split("_")[1]]
                assert reads == [f"layers.{layer}.mlp.experts.{e}.{w}.weight" for e in range(4)], t.name
            else:
                assert not any(".experts." in r for r in reads), t.name
            reads.clear()


# Llama 3.1's real tokenizer takes llama.cpp most of a minute: its vocabulary does not depend
# on the outtype, so two outtypes (auto and q8_0) cover it; the small families take all five.
META_CASES = [(f, d) for f in ("llama2", "mistral", "mixtral") for d in OUTTYPES] + [
    ("llama3_1-real-tokenizer", d) for d in (None, "q8_0")
]
# sentencepiece's default normalization (no tokenizer.json in the HF folder llama.cpp reads)
META_CASES += [("llama2-nfkc", None)]
# Families with no Meta layout come from ckptkit's internal format (Gemma 3's rope bases per
# layer type, soft-capping, sliding window)
META_CASES += [("internal/gemma3_text", None)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), META_CASES)
def test_meta_to_gguf_directly_equals_llama_cpp_on_the_hf_copy(
    family: str, dtype: str | None, llama_cpp: Path, hf_reference: Any, tmp_path: Path
) -> None:
    """Meta ranks go to GGUF with no HF step, as llama.cpp converts the HF folder ckptkit writes
    (Llama 3.1: Meta's real tokenizer, the Llama 3 pre-tokenizer hash, the rope_freqs tensor);
    that HF folder, as an HF source, gives the same file. Internal checkpoints too, against the
    HF folder ``--to hf`` restores from them."""
    pre = None
    if family.startswith("llama3_1"):
        src, hf = tmp_path / "meta", tmp_path / "hf"
        write_tiny_meta_llama3(src)
        convert(src, hf, ConvertOptions("hf"))
        theirs = llama_cpp_gguf(llama_cpp, hf, tmp_path / "theirs.gguf", OUTTYPES[dtype])
    else:
        src, hf, theirs, pre = hf_reference(family if "/" in family else f"meta/{family}", dtype)
    opts = ConvertOptions("gguf", dtype=dtype, allow_lossy_cast=dtype is not None, gguf_pre=pre)
    convert(src, tmp_path / "ours.gguf", opts)
    assert_same_gguf(tmp_path / "ours.gguf", theirs)
    if dtype is None or not family.startswith("llama3_1"):  # the real vocabulary once (it takes a while)
        convert(hf, tmp_path / "from-hf.gguf", opts)
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
        convert(src, tmp_path / fmt, ConvertOptions(fmt))
        convert(tmp_path / fmt, tmp_path / f"{fmt}.gguf", ConvertOptions("gguf"))
        assert_same_gguf(tmp_path / f"{fmt}.gguf", theirs)


@pytest.mark.parametrize("family", ["llama2", "mixtral"])
def test_two_meta_ranks_give_the_gguf_of_one(family: str, tmp_path: Path) -> None:
    convert(FIXTURES / "meta" / f"{family}-2rank", tmp_path / "two.gguf", ConvertOptions("gguf", dtype="q8_0"))
    convert(FIXTURES / "meta" / family, tmp_path / "one.gguf", ConvertOptions("gguf", dtype="q8_0"))
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
    convert(FIXTURES / "hf" / "llama2", dst, ConvertOptions("gguf"))
    before = dst.read_bytes()
    with pytest.raises(CkptkitError, match="exists"):
        convert(FIXTURES / "hf" / "llama2", dst, ConvertOptions("gguf", dtype="q8_0"))
    assert dst.read_bytes() == before
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.gguf"]
    convert(FIXTURES / "hf" / "llama2", dst, ConvertOptions("gguf", dtype="q8_0", force=True))
    assert dst.read_bytes() != before


def test_q8_0_is_refused_for_other_targets(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match="--dtype q8_0 applies only to --to gguf"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "x", ConvertOptions("hf", dtype="q8_0"))
    assert not (tmp_path / "x").exists()


def test_gguf_destination_must_end_in_gguf(tmp_path: Path) -> None:
    with pytest.raises(FlagError, match=r"--to gguf writes one file; name DST ending in \.gguf$"):
        convert(FIXTURES / "hf" / "llama2", tmp_path / "model.bin", ConvertOptions("gguf"))
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
        convert(src, tmp_path / "out.gguf", ConvertOptions("gguf"))
    message = f"{src}: no tokenizer.json or tokenizer.model; llama.cpp needs a tokenizer: pass --tokenizer PATH"
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
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
        convert(src, tmp_path / "g.gguf", ConvertOptions("gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma3"]


def test_gemma_settings_a_gguf_cannot_hold_are_noted_when_llama_cpp_would_run_others(tmp_path: Path) -> None:
    """Gemma 2 / 3 GGUFs have no key for query_pre_attn_scalar or layer_types: llama.cpp
    scales queries by head_dim (12 here) and makes every 2nd / 6th layer global. The
    fixtures' 16 and [sliding, full, sliding] are noted where they differ."""
    notes = {}
    for family in ("gemma2", "gemma3_text"):
        result = convert(FIXTURES / "hf" / family, tmp_path / f"{family}.gguf", ConvertOptions("gguf"))
        notes[family] = [n for n in result.notes if "GGUF has no key for" in n]
    assert len(notes["gemma2"]) == 1 and "query_pre_attn_scalar 16 (llama.cpp assumes 12)" in notes["gemma2"][0]
    assert "layer_types" not in notes["gemma2"][0]  # its layers already alternate as llama.cpp's do
    assert len(notes["gemma3_text"]) == 1 and "query_pre_attn_scalar 16" in notes["gemma3_text"][0]
    assert (
        "(llama.cpp assumes ['sliding_attention', 'sliding_attention', 'sliding_attention'])" in notes["gemma3_text"][0]
    )
