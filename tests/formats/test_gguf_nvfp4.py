"""modelopt NVFP4 sources to GGUF as llama.cpp's converter writes them: the weights kept in
GGML's NVFP4 type (repacked by its ``_nvfp4_pack``, Q/K rows permuted), each followed by its
``weight_scale_2`` (``.scale``) and ``input_scale`` (``.input_scale``), F32 [1]; every outtype
byte for byte its ``convert_hf_to_gguf.py`` output; a MoE's experts merged per layer and
projection with per-expert scale vectors. Read back to HF at bf16 by default: the weights are
the source's dequantization, bit for bit (``verify``: DEQUANTIZED).

Fixtures: ``fixtures/modelopt/nvfp4`` and ``nvfp4-moe`` (``fixtures/make_nvfp4_fixtures.py``)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_family_helpers import llama_cpp_references
from nvfp4_helpers import llama_cpp_pack, modelopt_dequantized
from safetensors.torch import load_file, save_file
from test_gguf import OUTTYPES, assert_same_gguf

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.verify import verify_paths

from conftest import FIXTURES

NV = FIXTURES / "modelopt" / "nvfp4"
MOE = FIXTURES / "modelopt" / "nvfp4-moe"
PRE = "llama-bpe"  # the fixture's tiny byte-level BPE tokenizer, named to both converters
HEADS = {"q_proj": 4, "k_proj": 2}  # the rows llama.cpp permutes, over these heads


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nv") / "bf16.gguf"
    convert(NV, out, ConvertOptions("gguf", dtype="bfloat16", gguf_pre=PRE))
    return out


@pytest.fixture(scope="module")
def ours_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nv") / "moe.gguf"
    convert(MOE, out, ConvertOptions("gguf", dtype="bfloat16", gguf_pre=PRE))
    return out


def _meta_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half rows in Meta's interleaved order (llama.cpp's ``LlamaModel.permute``)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _hf_name(gguf_name: str) -> str:
    bid, part = gguf_name.split(".")[1:3]
    proj = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    proj |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    return f"model.layers.{bid}.{proj[part]}"


def test_weights_are_llama_cpps_repacking_with_their_scales(ours: Path, llama_cpp: Path) -> None:
    """Each NVFP4 tensor is llama.cpp's ``_nvfp4_pack`` of the stored weight and block scales
    (rows permuted first for Q/K); ``.scale`` is ``weight_scale_2``, ``.input_scale`` the
    activation scale; ``general.file_type`` MOSTLY_NVFP4."""
    import gguf

    pack = llama_cpp_pack(llama_cpp)
    stored = load_file(NV / "model.safetensors")
    reader = gguf.GGUFReader(ours)
    tensors = {t.name: t for t in reader.tensors}
    nv = [n for n, t in tensors.items() if t.tensor_type == gguf.GGMLQuantizationType.NVFP4]
    assert len(nv) == 12 and [t.name for t in reader.tensors][:3] == [
        nv[0],
        *(nv[0][:-6] + s for s in ("scale", "input_scale")),
    ]
    for name in nv:
        module = _hf_name(name)
        w, s = stored[module + ".weight"], stored[module + ".weight_scale"]
        heads = HEADS.get(module.rsplit(".", 1)[-1])
        if heads:
            w, s = _meta_rows(w, heads), _meta_rows(s, heads)
        raw, shape = pack(w, s)
        assert tensors[name].data.tobytes() == raw.tobytes(), name
        assert [int(d) for d in tensors[name].shape][::-1] == shape
        scale_2 = tensors[name.replace(".weight", ".scale")].data
        assert scale_2.tobytes() == stored[module + ".weight_scale_2"].reshape(1).numpy().tobytes()
        assert tensors[name.replace(".weight", ".input_scale")].data.tolist() == [np.float32(0.02)]
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_NVFP4


def test_blocks_decode_to_the_gguf_packages_values() -> None:
    """Every scale byte and code: ckptkit's decoding equals ``gguf.quants.dequantize``'s
    values, bit for bit but for zeros, where ckptkit keeps the sign of the code -0."""
    import gguf
    import gguf.quants

    from ckptkit.formats.gguf.nvfp4 import ggml_values

    blocks = torch.randint(0, 256, (4096, 36), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    blocks[:256, 0] = torch.arange(256, dtype=torch.uint8)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.NVFP4))
    got = ggml_values(blocks)
    assert torch.equal(got, theirs.float())
    differ = got.view(torch.int32) != theirs.view(torch.int32)
    assert bool((got[differ] == 0).all() and got[differ].signbit().all())


def test_experts_are_merged_as_llama_cpp_merges_them(ours_moe: Path, llama_cpp: Path) -> None:
    """Each layer's experts of a projection: one NVFP4 tensor [E, rows, cols], llama.cpp's
    ``_nvfp4_pack`` of each expert stacked in expert order, written once its last expert is
    read (down, gate, up: the names' sorted order), followed by the experts' ``weight_scale_2``
    and ``input_scale`` as F32 [E]; the attention weights as for a dense model."""
    import gguf

    pack = llama_cpp_pack(llama_cpp)
    stored = load_file(MOE / "model.safetensors")
    reader = gguf.GGUFReader(ours_moe)
    tensors = {t.name: t for t in reader.tensors}
    merged = [f"blk.0.ffn_{p}_exps.{s}" for p in ("down", "gate", "up") for s in ("weight", "scale", "input_scale")]
    assert [t.name for t in reader.tensors][:9] == merged
    for layer in (0, 1):
        for proj in ("gate", "up", "down"):
            experts = [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj" for e in range(4)]
            name = f"blk.{layer}.ffn_{proj}_exps"
            raws = [pack(stored[m + ".weight"], stored[m + ".weight_scale"]) for m in experts]
            assert tensors[name + ".weight"].data.tobytes() == np.stack([r for r, _ in raws]).tobytes(), name
            assert [int(d) for d in tensors[name + ".weight"].shape][::-1] == [4, *raws[0][1]]
            scale_2 = torch.stack([stored[m + ".weight_scale_2"] for m in experts])
            assert tensors[name + ".scale"].data.tobytes() == scale_2.numpy().tobytes()
            inputs = [np.float32(0.02 + e / 1000) for e in range(4)]
            assert tensors[name + ".input_scale"].data.tolist() == inputs
    nv = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.NVFP4]
    assert len(nv) == 14 and len(reader.tensors) == 55


@pytest.mark.parametrize(("source", "weights", "verdict"), [(NV, 12, "9 of 21"), (MOE, 32, "13 of 45")])
def test_read_back_is_the_sources_dequantization(
    source: Path, weights: int, verdict: str, ours: Path, ours_moe: Path, tmp_path: Path
) -> None:
    """bf16 by default and float32 alike, bit for bit modelopt's dequantization of the source
    (signed zeros included): each value times its block's float32 ``e4m3 x .scale``, each
    expert's of a merged weight its own."""
    gguf_file = ours if source == NV else ours_moe
    convert(gguf_file, tmp_path / "hf", ConvertOptions("hf"))
    assert verify_paths(source, tmp_path / "hf").verdict().startswith(f"DEQUANTIZED: {verdict} tensors bitwise equal")
    convert(gguf_file, tmp_path / "f32", ConvertOptions("hf", dtype="float32"))
    stored, back = load_file(source / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    wide = load_file(tmp_path / "f32" / "model.safetensors")
    same = 0
    for name, w in stored.items():
        if w.dtype != torch.uint8:
            continue
        module = name.removesuffix(".weight")
        ref = modelopt_dequantized(w, stored[module + ".weight_scale"], stored[module + ".weight_scale_2"])
        bf16 = torch.equal(back[name].view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
        same += bf16 and torch.equal(wide[name].view(torch.int32), ref.view(torch.int32))
    assert same == weights


def _down_proj_quantized(out: Path) -> Path:
    """The fixture with ``mlp.down_proj`` quantized too: rows of 96 values (six NVFP4 blocks)."""
    sys.path.insert(0, str(FIXTURES))
    from make_nvfp4_fixtures import nvfp4

    shutil.copytree(NV, out)
    t = load_file(out / "model.safetensors")
    for layer in (0, 1):
        module = f"model.layers.{layer}.mlp.down_proj"
        t[module + ".weight"], t[module + ".weight_scale"], t[module + ".weight_scale_2"] = nvfp4(t[module + ".weight"])
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["exclude_modules"] = ["lm_head"]
    (out / "config.json").write_text(json.dumps(doc))
    return out


def _as_mixtral(out: Path) -> Path:
    """The MoE fixture renamed as a Mixtral (experts ``block_sparse_moe.experts.E.w1/w2/w3``),
    whose NVFP4 experts llama.cpp's converter cannot name ("Can not map tensor")."""
    names = {"mlp.gate.": "block_sparse_moe.gate.", "mlp.experts.": "block_sparse_moe.experts."}
    names |= {".gate_proj.": ".w1.", ".down_proj.": ".w2.", ".up_proj.": ".w3."}
    out.mkdir()
    renamed = {}
    for name, t in load_file(MOE / "model.safetensors").items():
        if "_norm." in name and "self_attn" in name:
            continue  # Mixtral has no Q/K norms
        for a, b in names.items():
            name = name.replace(a, b) if "experts" in name or a.startswith("mlp.gate") else name
        renamed[name] = t
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((MOE / "config.json").read_text())
    doc |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 64}
    doc["quantization_config"]["exclude_modules"] = ["lm_head", "model.layers.*.block_sparse_moe.gate"]
    (out / "config.json").write_text(json.dumps(doc))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MOE / f, out / f)
    return out


@pytest.mark.parametrize(
    ("source", "dtype", "says"),
    [
        ("rows", None, r"down_proj.weight has rows of 96 values; GGML's NVFP4 type holds rows of whole 64-value"),
        ("fixture", "Q4_K_M", r"--dtype Q4_K_M: ckptkit does not re-quantize NVFP4 weights as llama-quantize does"),
        ("mixtral", None, r"llama.cpp has no GGUF name for NVFP4 weight 'model.layers.0.block_sparse_moe.experts.0.w"),
    ],
)
def test_refused_in_one_line(source: str, dtype: str | None, says: str, tmp_path: Path) -> None:
    sources = {"rows": _down_proj_quantized, "mixtral": _as_mixtral}
    src = sources[source](tmp_path / "src") if source in sources else NV
    with pytest.raises(CkptkitError, match=says):
        convert(src, tmp_path / "out.gguf", ConvertOptions("gguf", dtype=dtype, gguf_pre=PRE))
    assert not (tmp_path / "out.gguf").exists()


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


@pytest.mark.slow
@pytest.mark.parametrize("source", [NV, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_nvfp4_release_to_gguf_equals_llama_cpp(
    source: Path, dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """Every outtype the converter takes: 45/45 tensors of the dense fixture (12 NVFP4, their
    24 scales, 9 others), 55/55 of the MoE (6 merged experts and 8 attention weights, their 28
    scales, 13 others)."""
    convert(source, tmp_path / "ours.gguf", ConvertOptions("gguf", dtype=dtype, gguf_pre=PRE))
    assert_same_gguf(tmp_path / "ours.gguf", reference(source, dtype))


@pytest.mark.slow
def test_llama_cpps_gguf_reads_back_dequantized(reference: Callable[[Path, str | None], Path], tmp_path: Path) -> None:
    convert(reference(NV, "bfloat16"), tmp_path / "hf", ConvertOptions("hf"))
    assert verify_paths(NV, tmp_path / "hf").verdict().startswith("DEQUANTIZED: 9 of 21 tensors bitwise equal")


def test_a_scale_that_is_not_a_number_is_refused(ours: Path, tmp_path: Path) -> None:
    import gguf

    bad = shutil.copy(ours, tmp_path / "bad.gguf")
    found = next(t for t in gguf.GGUFReader(bad).tensors if t.name.endswith(".scale"))
    with open(bad, "r+b") as f:
        f.seek(found.data_offset)
        f.write(np.float32("nan").tobytes())
    with pytest.raises(CkptkitError, match=r"the scale of NVFP4 weight '.*' is nan, not a finite number"):
        convert(bad, tmp_path / "hf", ConvertOptions("hf"))
    assert not (tmp_path / "hf").exists()
