"""DeepSeek V3 to GGUF as llama.cpp's ``deepseek2`` writes it: byte for byte its
``convert_hf_to_gguf.py`` output for every outtype, ``kv_b_proj`` split per head into
``attn_k_b`` (transposed) and ``attn_v_b``, experts merged, the router bias as
``exp_probs_b.bias``, the MTP layer left out as llama.cpp leaves it out (noted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf_family_helpers import assert_reads_back, llama_cpp_references
from test_gguf import OUTTYPES, assert_same_gguf, llama_cpp_ggufs

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES

NAMES = ["deepseek_v3", "deepseek_v3-qproj"]
PRE = "llama-bpe"  # the fixtures' tiny Llama 3 style tokenizer, whose hash llama.cpp cannot know


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    """llama.cpp's GGUF of an HF folder for an outtype, every outtype from one converter process."""
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(OUTTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_hf_to_gguf_equals_llama_cpp(
    name: str, dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    ours = tmp_path / "ours.gguf"
    opts = ConvertOptions("gguf", gguf_pre=PRE, dtype=dtype, allow_lossy_cast=dtype is not None)
    convert(FIXTURES / "hf" / name, ours, opts)
    assert_same_gguf(ours, reference(FIXTURES / "hf" / name, dtype))


def test_kv_b_is_split_per_head_and_the_mtp_layer_left_out(tmp_path: Path) -> None:
    from gguf import GGUFReader
    from safetensors import safe_open

    src = FIXTURES / "hf" / "deepseek_v3"
    result = convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    tensors = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert not [n for n in tensors if n.startswith("blk.3.")]  # 3 layers + the MTP layer
    assert "blk.1.exp_probs_b.bias" in tensors and "blk.1.ffn_gate_exps.weight" in tensors
    files = sorted(src.glob("*.safetensors"))
    kv_b = next(
        f.get_tensor("model.layers.2.self_attn.kv_b_proj.weight")
        for p in files
        if "model.layers.2.self_attn.kv_b_proj.weight" in (f := safe_open(p, "pt")).keys()
    )
    heads = kv_b.view(3, 12 + 10, 20)  # 3 heads of 12 key (nope) rows then 10 value rows, rank 20
    k_b, v_b = tensors["blk.2.attn_k_b.weight"], tensors["blk.2.attn_v_b.weight"]
    assert k_b.data.tobytes() == heads[:, :12].transpose(1, 2).contiguous().view(torch.int16).numpy().tobytes()
    assert v_b.data.tobytes() == heads[:, 12:].contiguous().view(torch.int16).numpy().tobytes()
    assert [n for n in result.notes if "MTP" in n] == [
        "32 tensor(s) of the MTP layer(s) past num_hidden_layers not written, as llama.cpp skips them"
    ]


def test_internal_copy_gives_the_gguf_of_the_hf_folder_it_came_from(tmp_path: Path) -> None:
    src = FIXTURES / "hf" / "deepseek_v3-qproj"
    convert(src, tmp_path / "int", ConvertOptions("internal"))
    convert(src, tmp_path / "a.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    convert(tmp_path / "int", tmp_path / "b.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    assert_same_gguf(tmp_path / "b.gguf", tmp_path / "a.gguf")  # general.name aside: the folder's


def test_gguf_reads_back_kv_b_joined_and_the_mtp_layer_gone(tmp_path: Path) -> None:
    """ckptkit's GGUF (llama.cpp's, byte for byte: the slow tests) converts back to every
    tensor of the fixture but the MTP layer's, bit for bit."""
    from ckptkit.checkpoint import open_checkpoint

    src = FIXTURES / "hf" / "deepseek_v3"
    convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    convert(tmp_path / "m.gguf", tmp_path / "back", ConvertOptions("hf"))
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "back") as b:
        assert sorted(b.tensors) == sorted(k for k in a.tensors if not k.startswith("mtp."))
        differ = [k for k in b.tensors if not torch.equal(a.tensors[k].get(), b.tensors[k].get())]
        assert differ == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_gguf_reads_back_bitwise_but_the_mtp_layer(
    name: str, dtype: str, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """kv_b_proj joined back from attn_k_b / attn_v_b, experts split, the router bias renamed
    back; the MTP layer llama.cpp leaves out is not in the GGUF to give back (nor counted)."""
    src = FIXTURES / "hf" / name
    ignored = frozenset({"num_nextn_predict_layers", "mtp_stored"})
    assert_reads_back(reference(src, dtype), src, tmp_path / "hf", left_out="mtp.", ignored=ignored)


def release_config(out: Path) -> Path:
    """The q LoRA fixture with its config.json as DeepSeek's release spells it: no head_dim, the
    router's score function, yarn rope scaling with DeepSeek's mscale (the keys llama.cpp adds)."""
    import json
    import shutil

    shutil.copytree(FIXTURES / "hf" / "deepseek_v3", out)
    config = json.loads((out / "config.json").read_text())
    for key in ("head_dim", "rope_parameters", "qk_head_dim"):
        config.pop(key)
    config |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 10000.0}
    config["rope_scaling"] = {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "type": "yarn",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@pytest.mark.slow
def test_release_config_gives_llama_cpp_s_keys(llama_cpp: Path, tmp_path: Path) -> None:
    src = release_config(tmp_path / "deepseek_v3")
    theirs = llama_cpp_ggufs(llama_cpp, src, {"bf16": tmp_path / "theirs.gguf"}, PRE)["bf16"]
    convert(src, tmp_path / "ours.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    assert_same_gguf(tmp_path / "ours.gguf", theirs)
