"""GLM-4.5 to GGUF as llama.cpp's ``glm4moe`` writes it: byte for byte its
``convert_hf_to_gguf.py`` output for every outtype, experts merged, the router bias as
``exp_probs_b.bias``, the NextN layer written as block ``num_hidden_layers`` (``nextn.*``),
GLM's special tokens by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_family_helpers import assert_reads_back, llama_cpp_references
from test_gguf import OUTTYPES, assert_same_gguf

from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError

from conftest import FIXTURES

SRC = FIXTURES / "hf" / "glm4_moe"
PRE = "glm4"  # the fixture's tiny tokenizer, whose hash llama.cpp cannot know


@pytest.fixture(scope="module")
def reference(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], Path]:
    """llama.cpp's GGUF of an HF folder for an outtype, every outtype from one converter process."""
    return llama_cpp_references(llama_cpp, tmp_path_factory, PRE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(OUTTYPES))
def test_hf_to_gguf_equals_llama_cpp(
    dtype: str | None, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    ours = tmp_path / "ours.gguf"
    opts = ConvertOptions("gguf", gguf_pre=PRE, dtype=dtype, allow_lossy_cast=dtype is not None)
    convert(SRC, ours, opts)
    assert_same_gguf(ours, reference(SRC, dtype))


def test_nextn_layer_is_block_n_with_its_experts_merged_and_glm_specials(tmp_path: Path) -> None:
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file

    convert(SRC, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    reader = GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    nextn = sorted(n.removeprefix("blk.3.") for n in tensors if n.startswith("blk.3.nextn."))
    names = ["eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm"]
    assert nextn == [f"nextn.{n}.weight" for n in names]
    assert {"blk.3.ffn_down_exps.weight", "blk.3.exp_probs_b.bias", "blk.1.attn_q_norm.weight"} <= set(tensors)
    stored = {k: v for p in sorted(SRC.glob("*.safetensors")) for k, v in load_file(p).items()}
    up = torch.stack([stored[f"model.layers.3.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    assert tensors["blk.3.ffn_up_exps.weight"].data.tobytes() == up.view(torch.int16).numpy().tobytes()
    field = reader.fields

    def value(key: str) -> int:
        return int(field[key].parts[field[key].data[0]][0])

    assert value("glm4moe.block_count") == 4 and value("glm4moe.nextn_predict_layers") == 1
    assert value("glm4moe.rope.dimension_count") == 6  # half of head_dim 12
    ids = {k: value(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eot", "eom")}
    assert ids == {"bos": 374, "eot": 379, "eom": 381}  # [gMASK], <|user|>, <|observation|>


def test_a_tokenizer_without_glm_s_special_tokens_is_refused_in_one_line(tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    shutil.copy(FIXTURES / "hf" / "deepseek_v3" / "tokenizer.json", src / "tokenizer.json")
    with pytest.raises(CkptkitError, match=r"no \[gMASK\] token, which llama.cpp reads as bos"):
        convert(src, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))


def test_gguf_reads_back_bitwise_with_its_glm4_tokenizer(tmp_path: Path) -> None:
    from ckptkit.verify import verify_paths

    convert(SRC, tmp_path / "m.gguf", ConvertOptions("gguf", gguf_pre=PRE))
    result = convert(tmp_path / "m.gguf", tmp_path / "back", ConvertOptions("hf"))
    assert verify_paths(SRC, tmp_path / "back").identical == verify_paths(SRC, SRC).identical
    assert not [n for n in result.notes if "tokenizer" in n]
    assert (tmp_path / "back" / "tokenizer.json").is_file()  # its ids: test_gguf_vocab_rebuild.py


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llama_cpp_gguf_reads_back_bitwise(
    dtype: str, reference: Callable[[Path, str | None], Path], tmp_path: Path
) -> None:
    """Experts split, the NextN layer's blocks back under their HF names, the layer count without them."""
    assert_reads_back(reference(SRC, dtype), SRC, tmp_path / "hf")
