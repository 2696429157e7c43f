"""GGUF read back: files written by llama.cpp's own converter (the llama-cpp-python sdist)
convert to HF, Meta and internal and ``ckptkit verify`` finds them bitwise equal to the HF
model llama.cpp read; config, tokenizer and generation config are rebuilt from the metadata.

References: llama.cpp's ``convert_hf_to_gguf.py`` (writes the GGUFs), the HF fixtures
(configs as transformers wrote them), the ``tokenizers`` library on the fixtures' own
``tokenizer.json``, llama.cpp's vocabulary GGUFs with their official test ids, Meta's Llama 3
``tokenizer.model``, and the ``gguf`` package's ``dequantize`` for quantized tensors.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf import all_moe_qwen3, assert_same_gguf, llama_cpp_gguf, tiny_bpe
from typer.testing import CliRunner

from ckptkit.checkpoint import open_checkpoint
from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.verify import verify_paths

from conftest import FIXTURES
from tokenizer_helpers import CORPUS, llama_cpp_dir, vocab_tests, write_tiny_meta_llama3

# Fields GGUF does not hold: training-only dropout rates, Qwen2's sliding-window layer count.
NOT_IN_GGUF = {"resid_pdrop", "embd_pdrop", "max_window_layers"}


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


def encode_all(folder: Path, texts: list[str], bos: bool = True) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tok.encode(t, add_special_tokens=bos).ids for t in texts]


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "bf16", "auto"])
@pytest.mark.parametrize("family", ["llama2", "mistral", "gemma", "phi3", "qwen2"])
def test_llama_cpp_gguf_converts_back_to_the_hf_model_bitwise(
    family: str, outtype: str, llama_cpp: Path, tmp_path: Path
) -> None:
    """Q/K permutation undone, Gemma's 1 + w undone exactly; llama.cpp stores norms (and with
    f32 everything) as float32, so --dtype bfloat16 gives back the bf16 model. (The Qwen2
    fixture's byte-level BPE is no tokenizer llama.cpp knows: it gets Llama 2's fixture
    sentencepiece model, which llama.cpp's Qwen2 class tries first.)"""
    src = FIXTURES / "hf" / family
    if family == "qwen2":
        src = tmp_path / "qwen2"
        shutil.copytree(FIXTURES / "hf" / "qwen2", src, ignore=shutil.ignore_patterns("tokenizer*"))
        shutil.copy(FIXTURES / "hf" / "llama2" / "tokenizer.model", src)
    gguf = llama_cpp_gguf(llama_cpp, src, tmp_path / "m.gguf", outtype)
    convert(gguf, tmp_path / "hf", ConvertOptions("hf", dtype="bfloat16"))
    code, out, err = cli("verify", src, tmp_path / "hf")
    assert code == 0, out + err
    assert verify_paths(src, tmp_path / "hf").identical == verify_paths(src, src).identical
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "hf") as b, open_checkpoint(gguf) as g:
        assert b.family.name == a.family.name == g.family.name
        differ = {k for k, v in a.config.to_dict().items() if b.config.to_dict()[k] != v}
        assert differ <= NOT_IN_GGUF, differ
    import sentencepiece

    # The reference is sentencepiece on the fixture's tokenizer.model (its tokenizer.json, transformers
    # 5's Metaspace layout, drops the dummy prefix before a leading space, which sentencepiece keeps).
    original = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    rebuilt = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "hf" / "tokenizer.model"))
    # the same pieces (llama.cpp re-types and re-scores added tokens: Phi-3's <unk> becomes control)
    assert [rebuilt.id_to_piece(i) for i in range(rebuilt.get_piece_size())] == [
        original.id_to_piece(i) for i in range(original.get_piece_size())
    ]
    texts = [t for t in CORPUS if t]
    if family == "gemma":  # llama.cpp writes Gemma's add_space_prefix = false whatever the model says
        original = rebuilt
        assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["normalizer"]["normalizers"][0] != {
            "type": "Prepend",
            "prepend": "▁",
        }
    assert [rebuilt.encode(t) for t in texts] == [original.encode(t) for t in texts]
    assert encode_all(tmp_path / "hf", texts, bos=False) == [original.encode(t) for t in texts]
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    original = json.loads((src / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("bos_token_id", "eos_token_id")} == {
        k: original[k] for k in ("bos_token_id", "eos_token_id")
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_llama_cpp_moe_gguf_converts_back_in_either_experts_layout_bitwise(
    family: str, llama_cpp: Path, tmp_path: Path
) -> None:
    """ffn_*_exps split back into one tensor per expert (the default) or transformers' stacked
    gate_up_proj / down_proj (--experts stacked), the router from ffn_gate_inp: each verifies
    bitwise against transformers' own save in that layout, and transformers gives the same
    logits. (Qwen3-MoE: experts in every layer, llama.cpp's qwen3moe has no dense ones; its
    tiny BPE tokenizer is given Qwen2's pre-tokenizer.)"""
    if family == "qwen3_moe":
        src, pre = all_moe_qwen3(tmp_path / "src"), "qwen2"
    else:
        src, pre = {"per-expert": FIXTURES / "hf" / "mixtral", "stacked": FIXTURES / "hf" / "mixtral-stacked"}, None
    gguf = llama_cpp_gguf(llama_cpp, src["per-expert"], tmp_path / "m.gguf", "auto", pre)
    for layout, option in (("per-expert", []), ("stacked", ["--experts", "stacked"])):
        code, out, err = cli("convert", gguf, tmp_path / layout, "--to", "hf", "--dtype", "bfloat16", *option)
        assert code == 0, out + err
        code, out, err = cli("verify", src[layout], tmp_path / layout)
        assert code == 0 and "IDENTICAL" in out, out + err
    with (
        open_checkpoint(src["per-expert"]) as a,
        open_checkpoint(tmp_path / "stacked") as b,
        open_checkpoint(gguf) as g,
    ):
        assert a.family.name == b.family.name == g.family.name == family
        differ = {k for k, v in a.config.to_dict().items() if b.config.to_dict()[k] != v}
        # GGUF holds the tokenizer's pad token (Qwen2's <|endoftext|>), not config.json's null
        assert differ <= NOT_IN_GGUF | {"experts_layout", "pad_token_id"}, differ
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = [
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits
        for d in (src["per-expert"], tmp_path / "stacked")
    ]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.slow
def test_an_f32_gguf_keeps_float32_without_dtype_and_verifies_as_casts(llama_cpp: Path, tmp_path: Path) -> None:
    gguf = llama_cpp_gguf(llama_cpp, FIXTURES / "hf" / "llama2", tmp_path / "m.gguf", "f32")
    convert(gguf, tmp_path / "hf", ConvertOptions("hf"))
    report = verify_paths(FIXTURES / "hf" / "llama2", tmp_path / "hf")
    assert report.cast_only and len(report.differences) == report.compared  # every tensor, in float32
    assert {d.dtype_b for d in report.differences} == {"float32"}
    assert verify_paths(gguf, tmp_path / "hf").ok  # and the GGUF itself verifies against its output


def _set_first_value(gguf: Path, name: str, value: float) -> None:
    from gguf import GGUFReader

    at = next(int(t.data_offset) for t in GGUFReader(gguf).tensors if t.name == name)
    data = bytearray(gguf.read_bytes())
    data[at : at + 4] = struct.pack("<f", value)
    gguf.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [("bfloat16", 1.2345678), ("float16", 2.0**-20 * (1 + 2.0**-7))],
    ids=["bf16-file,float32-value", "f16-file,bf16-value"],
)
def test_a_widened_tensor_comes_back_in_the_file_type_only_where_every_value_is_exact(
    dtype: str, value: float, tmp_path: Path
) -> None:
    """A norm holding one value the file type cannot hold (a full float32 mantissa in a bf16
    file; a bf16 value under float16's subnormal step in an f16 one) stays float32; the other
    F32 tensors come back in the file type. (ckptkit's GGUF: llama.cpp's bytes, test_gguf.py.)"""
    from safetensors.torch import load_file

    src = FIXTURES / "hf" / "llama2"
    gguf = tmp_path / "m.gguf"
    convert(src, gguf, ConvertOptions("gguf", dtype=dtype))
    _set_first_value(gguf, "blk.0.attn_norm.weight", value)
    convert(gguf, tmp_path / "hf", ConvertOptions("hf"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    patched = "model.layers.0.input_layernorm.weight"
    assert got[patched].dtype == torch.float32 and got[patched][0].item() == np.float32(value)
    assert {t.dtype for k, t in got.items() if k != patched} == {getattr(torch, dtype)}
    assert verify_paths(gguf, tmp_path / "hf").ok  # read as --to hf wrote it
    report = verify_paths(src, tmp_path / "hf")
    if dtype == "bfloat16":  # the source cast to float16 and back differs from it elsewhere too
        assert [(d.name_b, d.kind) for d in report.differences] == [(patched, "values")]


@pytest.mark.slow
def test_llama3_1_gguf_gives_back_rope_scaling_and_meta_tokenizer(llama_cpp: Path, tmp_path: Path) -> None:
    """rope_freqs.weight becomes Llama 3 rope scaling again; the byte-level BPE vocabulary
    becomes Meta's tiktoken tokenizer.model, byte for byte."""
    write_tiny_meta_llama3(tmp_path / "meta")
    convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))
    gguf = llama_cpp_gguf(llama_cpp, tmp_path / "hf", tmp_path / "m.gguf", "auto")
    for to in ("hf", "meta", "internal"):
        convert(gguf, tmp_path / f"back-{to}", ConvertOptions(to, dtype="bfloat16"))
        assert verify_paths(tmp_path / "hf", tmp_path / f"back-{to}").ok, to
    assert (tmp_path / "back-meta" / "tokenizer.model").read_bytes() == (
        tmp_path / "meta" / "tokenizer.model"
    ).read_bytes()
    assert json.loads((tmp_path / "back-meta" / "params.json").read_text()) == json.loads(
        (tmp_path / "meta" / "params.json").read_text()
    )
    config = json.loads((tmp_path / "back-hf" / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"] == original["rope_parameters"]
    texts = [*CORPUS, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]
    assert encode_all(tmp_path / "back-hf", texts) == encode_all(tmp_path / "hf", texts)


# What llama.cpp runs a Gemma 2 / Gemma 3 GGUF with where the file has no key (its C++ loader,
# src/models/gemma2.cpp and gemma3.cpp of the same sdist): queries scaled by 1/sqrt(head_dim)
# (hidden/heads at 46 / 62 layers), every 2nd / 6th layer global (set_swa_pattern). The
# fixtures' own values (query_pre_attn_scalar 16, layer 1 global) are not these.
AS_LLAMA_CPP_RUNS = {
    "gemma2": {"query_pre_attn_scalar": 12},
    "gemma3_text": {"query_pre_attn_scalar": 12, "layer_types": ["sliding_attention"] * 3},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text", "olmo2"])
def test_newer_family_gguf_equals_llama_cpp_and_comes_back_bitwise_running_as_the_source(
    family: str, llama_cpp: Path, tmp_path: Path
) -> None:
    """ckptkit's GGUF (outtype auto) is llama.cpp's; q_norm/k_norm, Gemma's four norms (1 + w
    undone), soft-capping, the sliding layers' own rope base come back from it; transformers
    gives the rebuilt folder the source's logits (the source read as llama.cpp runs it where
    the GGUF has no key), and its tokenizer the source's ids."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    src = FIXTURES / "hf" / family
    gguf = llama_cpp_gguf(llama_cpp, src, tmp_path / "m.gguf", "auto", tiny_bpe(family))
    convert(src, tmp_path / "ours.gguf", ConvertOptions("gguf", gguf_pre=tiny_bpe(family)))
    assert_same_gguf(tmp_path / "ours.gguf", gguf)
    convert(gguf, tmp_path / "hf", ConvertOptions("hf", dtype="bfloat16"))
    code, out, err = cli("verify", src, tmp_path / "hf")
    assert code == 0 and "IDENTICAL" in out, out + err
    assumed = AS_LLAMA_CPP_RUNS.get(family, {})
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "hf") as b:
        differ = {k for k, v in a.config.to_dict().items() if b.config.to_dict()[k] != v}
        # the GGUF's padding id is the tokenizer's pad token (Qwen's <|endoftext|>), null in config.json
        assert differ <= NOT_IN_GGUF | set(assumed) | {"pad_token_id"}, differ

    ids = torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(0))  # past the window of 5
    config = AutoConfig.from_pretrained(src)
    for key, value in assumed.items():
        setattr(config, key, value)
    logits = []
    for folder, cfg in ((src, config), (tmp_path / "hf", None)):
        kwargs = {"config": cfg} if cfg is not None else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])

    texts = [t for t in CORPUS if t]
    original, rebuilt = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (src, tmp_path / "hf"))
    if family.startswith("gemma"):  # llama.cpp writes add_space_prefix = false whatever the model says
        texts = [" " + t for t in texts]
    assert [rebuilt.encode(t).ids for t in texts] == [original.encode(t).ids for t in texts]


@pytest.mark.parametrize("vocab", ["llama-spm", "llama-bpe"])
def test_tokenizer_rebuilt_from_gguf_metadata_gives_the_official_ids(vocab: str, tmp_path: Path) -> None:
    """llama.cpp's vocabulary GGUFs (Llama 2's sentencepiece, Llama 3's byte-level BPE) with
    its test texts and the ids the official tokenizers give them."""
    from tokenizers import Tokenizer

    from ckptkit.formats.gguf.reader import read_header
    from ckptkit.formats.gguf.tokenizer import tokenizer_files

    files, notes = tokenizer_files(read_header(llama_cpp_dir() / "models" / f"ggml-vocab-{vocab}.gguf"), 4096)
    assert notes == []
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    cases = vocab_tests(vocab)
    assert [tok.encode(text, add_special_tokens=False).ids for text, _ in cases] == [ids for _, ids in cases]


# --- quantized tensors -------------------------------------------------------------------------------


@pytest.mark.slow
def test_q8_0_gguf_is_dequantized_to_bfloat16_or_the_dtype_given(llama_cpp: Path, tmp_path: Path) -> None:
    """The values are the gguf package's dequantization of llama.cpp's Q8_0, rows permuted back;
    without ``--dtype`` they are rounded to bfloat16, and the note says so."""
    from gguf import GGMLQuantizationType, GGUFReader, quants
    from safetensors.torch import load_file as load_torch

    gguf = llama_cpp_gguf(llama_cpp, FIXTURES / "hf" / "llama2", tmp_path / "m.gguf", "q8_0")
    code, _, err = cli("convert", gguf, tmp_path / "bf16", "--to", "hf")
    assert code == 0 and "(Q8_0) dequantized to bfloat16 (the default for quantized sources; --dtype" in err
    bf16 = load_torch(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    code, _, err = cli("convert", gguf, tmp_path / "hf", "--to", "hf", "--dtype", "float32")
    assert code == 0 and "lossy: 16 quantized tensors (Q8_0) dequantized to float32, llama.cpp" in err
    from safetensors.numpy import load_file

    stored = {t.name: t for t in GGUFReader(gguf).tensors}
    got = load_file(tmp_path / "hf" / "model.safetensors")
    config = json.loads((FIXTURES / "hf" / "llama2" / "config.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for gguf_name, hf_name, heads in [
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", n_head),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", n_kv),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ]:
        t = stored[gguf_name]
        assert t.tensor_type == GGMLQuantizationType.Q8_0
        ref = quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if heads:  # Meta's pairs back to HF's halves, per head
            rows = ref.shape[0]
            ref = ref.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        assert np.array_equal(got[hf_name].view(np.uint32), ref.astype(np.float32).view(np.uint32))
        rounded = torch.from_numpy(ref.astype(np.float32)).to(torch.bfloat16)
        assert torch.equal(bf16[hf_name].view(torch.int16), rounded.view(torch.int16))


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a quantized type with finite float16 scales (the rest random bits)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale_at = {"Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind]
    for at in scale_at:
        raw[:, at : at + 2] = rng.normal(0, 0.01, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // per * size)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantization_is_the_gguf_package_reference_bit_for_bit(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    from ckptkit.formats.gguf import quants as q

    monkeypatch.setattr(q, "CHUNK_BYTES", 3 * 210)  # a few blocks per chunk: chunk edges inside rows
    rows, cols = 5, 512
    raw = _random_blocks(kind, rows, cols, np.random.default_rng(7))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    data = raw.tobytes()
    out = q.dequantize_into(torch.empty(rows, cols), kind, lambda start, n: data[start : start + n])
    assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def write_llama_gguf(
    path: Path, kinds: dict[str, str], rng: np.random.Generator, blocks: Callable[..., np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF by the gguf package's writer (dims 256, 4 heads, 2 kv heads); the
    2-D tensors named in ``kinds`` blocks of that type (``blocks(kind, rows, columns, rng)``,
    random by default), the rest float32. Returns the stored tensors as the gguf package
    dequantizes them, by GGUF name."""
    import gguf

    dim, ffn, vocab, heads, kv = 256, 512, 256, 4, 2
    shapes = {
        "token_embd.weight": (vocab, dim), "blk.0.attn_q.weight": (dim, dim), "blk.0.attn_k.weight": (dim // 2, dim),
        "blk.0.attn_v.weight": (dim // 2, dim), "blk.0.attn_output.weight": (dim, dim),
        "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim), "blk.0.ffn_down.weight": (dim, ffn),
        "blk.0.attn_norm.weight": (dim,), "blk.0.ffn_norm.weight": (dim,), "output_norm.weight": (dim,),
        "output.weight": (vocab, dim),
    }  # fmt: skip
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (
        ("block_count", 1),
        ("context_length", 512),
        ("embedding_length", dim),
        ("feed_forward_length", ffn),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv),
    ):
        w.add_uint32(f"llama.{key}", value)  # fmt: skip
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("llama.rope.dimension_count", dim // heads)
    values = {}
    for name, shape in shapes.items():
        kind = kinds.get(name)
        if kind is None:
            data = rng.normal(0, 1, shape).astype(np.float32)
            w.add_tensor(name, data)
            values[name] = data
        else:
            raw = (blocks or _random_blocks)(kind, shape[0], shape[1], rng)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            values[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def test_k_quant_gguf_converts_with_dtype_to_the_reference_values(tmp_path: Path) -> None:
    kinds = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.ffn_down.weight": "Q6_K",
             "token_embd.weight": "Q8_0"}  # fmt: skip
    values = write_llama_gguf(tmp_path / "k.gguf", kinds, np.random.default_rng(3))
    result = convert(tmp_path / "k.gguf", tmp_path / "bf16", ConvertOptions("hf"))
    said = "lossy: 4 quantized tensors (Q4_K, Q5_K, Q6_K, Q8_0) dequantized to bfloat16 (the default"
    assert any(n.startswith(said) for n in result.notes)
    result = convert(tmp_path / "k.gguf", tmp_path / "hf", ConvertOptions("hf", dtype="float32"))
    assert any(n.startswith("lossy: 4 quantized tensors") for n in result.notes)
    assert any("holds no tokenizer" in n for n in result.notes)
    from safetensors.numpy import load_file

    got = load_file(tmp_path / "hf" / "model.safetensors")

    def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    expected = {
        "model.embed_tokens.weight": values["token_embd.weight"],
        "model.layers.0.self_attn.q_proj.weight": unpermute(values["blk.0.attn_q.weight"], 4),
        "model.layers.0.self_attn.k_proj.weight": unpermute(values["blk.0.attn_k.weight"], 2),
        "model.layers.0.mlp.down_proj.weight": values["blk.0.ffn_down.weight"],
        "model.layers.0.input_layernorm.weight": values["blk.0.attn_norm.weight"],
        "lm_head.weight": values["output.weight"],
    }
    for name, ref in expected.items():
        assert np.array_equal(got[name].view(np.uint32), ref.view(np.uint32)), name


# --- Gemma's 1 + w --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stored", [1 + 2.0**-20, 1.2345678], ids=["tiny-w", "float32-w"])
def test_gemma_norm_that_float_arithmetic_cannot_undo_is_refused(
    stored: float, llama_cpp: Path, tmp_path: Path
) -> None:
    """1 + 2^-20 (a bfloat16 w below 2^-16: float32's 1 + w dropped its low bits) and a w with
    a full float32 mantissa both have many w that give the same stored value."""
    from gguf import GGUFReader

    gguf = llama_cpp_gguf(llama_cpp, FIXTURES / "hf" / "gemma", tmp_path / "g.gguf", "f32")
    at = next(int(t.data_offset) for t in GGUFReader(gguf).tensors if t.name == "blk.0.attn_norm.weight")
    data = bytearray(gguf.read_bytes())
    data[at : at + 4] = struct.pack("<f", stored)
    gguf.write_bytes(bytes(data))
    code, _, err = cli("convert", gguf, tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "stored these norm weights as 1 + w in float32" in err and "cannot be recovered exactly" in err
    assert not (tmp_path / "hf").exists()


# --- inspect -----------------------------------------------------------------------------------------


def test_inspect_reads_the_header_only_whatever_the_file_size(tmp_path: Path) -> None:
    """A 64 GiB tensor region (a sparse file): inspect reads the header's window, no more."""
    import gguf

    from ckptkit.formats.gguf.reader import WINDOW, read_header

    big = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(big, "llama")
    w.add_uint32("llama.block_count", 1)
    f32 = gguf.GGMLQuantizationType.F32
    w.add_tensor_info("token_embd.weight", (1 << 24, 1024), np.dtype(np.float32), 1 << 36, raw_dtype=f32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(big, "r+b") as f:
        f.truncate(f.seek(0, 2) + (1 << 36) + 64)
    header = read_header(big)
    assert header.file_size > 1 << 36 and header.header_bytes <= WINDOW
    code, out, err = cli("inspect", big, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["total_bytes"] == 1 << 36 and info["tensors"][0]["shape"] == [1 << 24, 1024]


def test_inspect_shows_gguf_metadata_and_stored_types(tmp_path: Path) -> None:
    write_llama_gguf(tmp_path / "k.gguf", {"blk.0.attn_q.weight": "Q4_K"}, np.random.default_rng(1))
    code, out, err = cli("inspect", tmp_path / "k.gguf", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "gguf" and info["model_type"] == "llama2" and info["gguf_version"] == 3
    assert info["metadata"]["llama.attention.head_count_kv"] == 2
    assert info["metadata"]["llama.attention.layer_norm_rms_epsilon"] == 1e-5
    types = {t["name"]: t["dtype"] for t in info["tensors"]}
    assert types["blk.0.attn_q.weight"] == "q4_k" and types["output.weight"] == "float32"
    from gguf import GGUFReader

    assert info["total_bytes"] == sum(int(t.n_bytes) for t in GGUFReader(tmp_path / "k.gguf").tensors)


def test_gguf_to_gguf_keeps_llama_cpp_pad_fillers_unused(tmp_path: Path) -> None:
    """The ``[PAD{i}]`` fillers llama.cpp writes for ids the tokenizer lacks (fixture: 4 of 384)
    stay holes in the rebuilt tokenizer.json, so GGUF -> GGUF writes them UNUSED again and the
    vocabulary metadata comes back byte for byte."""
    import gguf

    convert(FIXTURES / "hf" / "llama3", tmp_path / "a.gguf", ConvertOptions("gguf", gguf_pre="llama-bpe"))
    convert(tmp_path / "a.gguf", tmp_path / "b.gguf", ConvertOptions("gguf"))
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    types = a.fields["tokenizer.ggml.token_type"]
    assert [int(types.parts[i][0]) for i in types.data].count(gguf.TokenType.UNUSED) == 4
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert [bytes(p) for p in a.fields[key].parts] == [bytes(p) for p in b.fields[key].parts], key
