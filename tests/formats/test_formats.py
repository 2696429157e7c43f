"""The streaming readers and writers against the reference libraries, and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cli_helpers import ckptkit_in_process
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats.safetensors_io import SafetensorsReader, SafetensorsWriter, library_order
from ckptkit.formats.torch_io import TorchPickleReader
from ckptkit.formats.torch_writer import TorchPickleWriter
from ckptkit.inspection import inspect_path

from conftest import FIXTURES

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.float64]

state_dicts = st.dictionaries(
    st.text("abcxyz._0123456789", min_size=1, max_size=12),
    st.tuples(st.lists(st.integers(0, 5), max_size=3), st.sampled_from(DTYPES)),
    min_size=1,
    max_size=6,
).map(lambda d: {k: (torch.rand(s) * 100).to(dt) for k, (s, dt) in d.items()})


@settings(max_examples=40, deadline=None)
@given(sd=state_dicts, reverse=st.booleans())
def test_safetensors_writer_is_byte_identical_to_the_library(sd: dict, reverse: bool, tmp_path_factory) -> None:
    d = tmp_path_factory.mktemp("st")
    save_file(sd, d / "ref.safetensors", metadata={"format": "pt"})
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()]
    order = library_order(entries)
    writer = SafetensorsWriter(
        d / "mine.safetensors", sorted(entries, key=lambda e: order.index(e[0])), {"format": "pt"}
    )
    for k in reversed(list(sd)) if reverse else sd:  # any write order
        writer.write(k, sd[k])
    writer.close()
    assert (d / "mine.safetensors").read_bytes() == (d / "ref.safetensors").read_bytes()
    reader = SafetensorsReader(d / "ref.safetensors")
    assert all(torch.equal(reader.read(k), v) for k, v in sd.items())


@settings(max_examples=30, deadline=None)
@given(sd=state_dicts)
def test_torch_writer_loads_with_torch_and_passes_zip_crc(sd: dict, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("pt") / "x.pth"
    writer = TorchPickleWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()])
    for k in reversed(list(sd)):
        writer.write(k, sd[k])
    writer.close()
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == list(sd)
        assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in sd.items())
    reader = TorchPickleReader(path)
    assert all(torch.equal(reader.read(k), v) for k, v in sd.items())


def test_inspect_json_describes_hf_fixture() -> None:
    from transformers import AutoModelForCausalLM

    out = ckptkit_in_process("inspect", FIXTURES / "hf" / "llama3", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["format"] == "hf" and info["model_type"] == "llama3"
    assert info["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "hf" / "llama3")
    assert info["num_params"] == model.num_parameters()
    assert (
        info["total_bytes"]
        == json.loads((FIXTURES / "hf" / "llama3" / "model.safetensors.index.json").read_text())["metadata"][
            "total_size"
        ]
    )
    assert {t["dtype"] for t in info["tensors"]} == {"bfloat16"}
    names = {t["name"]: t for t in info["tensors"]}
    assert names["model.layers.0.self_attn.k_proj.weight"]["shape"] == [32, 64]


@pytest.mark.parametrize("path", ["meta/llama2-2rank", "hf-bin/llama2", "meta/mistral", "hf/phi3"])
def test_inspect_reads_no_tensor_data(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(SafetensorsReader, "read", refuse)
    monkeypatch.setattr(TorchPickleReader, "read", refuse, raising=True)
    info = inspect_path(FIXTURES / path)
    assert info["tensors"] and info["model_type"]


def test_inspect_single_files() -> None:
    info = inspect_path(FIXTURES / "meta" / "llama2-2rank" / "consolidated.01.pth")
    assert info["format"] == "meta" and info["files"] == ["consolidated.01.pth"]
    info = inspect_path(FIXTURES / "hf" / "gemma" / "model.safetensors.index.json")
    assert len(info["files"]) == 3 and info["num_params"] > 0


def test_dtype_cast_and_verify(tmp_path: Path) -> None:
    convert(FIXTURES / "hf" / "qwen2", tmp_path / "f32", ConvertOptions("hf", dtype="float32", verify=True))
    with open_checkpoint(tmp_path / "f32") as ck:
        assert {t.dtype for t in ck.tensors.values()} == {"float32"}
    cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert cfg["dtype"] == "float32"
    res = ckptkit_in_process("verify", FIXTURES / "hf" / "qwen2", tmp_path / "f32", "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 1 and not report["identical"] and report["verdict"] == "cast"
    first = report["differences"][0]
    assert first["dtype_a"] == "bfloat16" and first["dtype_b"] == "float32" and first["kind"] == "cast"
    assert first["max_abs_diff"] == 0.0  # widening is exact


def test_non_weight_files_are_carried(tmp_path: Path) -> None:
    """HF -> Meta keeps Meta's tokenizer.model; the HF-only files come back with HF."""
    src = FIXTURES / "hf" / "mistral"
    convert(src, tmp_path / "m", ConvertOptions("meta"))
    assert (tmp_path / "m" / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    hf_only = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    assert not any((tmp_path / "m" / name).exists() for name in (*hf_only, "config.json"))
    convert(tmp_path / "m", tmp_path / "back", ConvertOptions("hf"))
    for name in (*hf_only, "tokenizer.model"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes()
    assert json.loads((tmp_path / "m" / "params.json").read_text())["n_kv_heads"] == 2


def test_max_shard_size_reshards_hf(tmp_path: Path) -> None:
    convert(FIXTURES / "hf" / "llama2", tmp_path / "one", ConvertOptions("hf", max_shard_size="10GB"))
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    convert(tmp_path / "one", tmp_path / "many", ConvertOptions("hf-bin", max_shard_size="100KB"))
    shards = sorted(p.name for p in (tmp_path / "many").glob("*.bin"))
    assert len(shards) > 2 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    index = json.loads((tmp_path / "many" / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)


@pytest.mark.slow
def test_cli_convert_prints_summary_and_quiet_prints_nothing(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "ckptkit", "convert", str(FIXTURES / "meta" / "llama2")]
    loud = subprocess.run([*base, str(tmp_path / "a"), "--to", "hf"], capture_output=True, text=True, check=True)
    assert "wrote" in loud.stderr and "rope.freqs" in loud.stderr  # says what it did not carry
    quiet = subprocess.run(
        [*base, str(tmp_path / "b"), "--to", "hf", "--quiet"], capture_output=True, text=True, check=True
    )
    assert quiet.stdout == "" and quiet.stderr == ""


def test_reads_the_transformers_4_config_spelling(tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "v4"
    shutil.copytree(FIXTURES / "hf" / "llama3_1", src)
    cfg = json.loads((src / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype")
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    with open_checkpoint(src) as v4, open_checkpoint(FIXTURES / "hf" / "llama3_1") as v5:
        assert v4.family.name == "llama3_1"
        assert v4.config == v5.config
    convert(src, tmp_path / "meta", ConvertOptions("meta"))
    convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf"))
    assert (tmp_path / "back" / "config.json").read_text() == (src / "config.json").read_text()


@settings(max_examples=30, deadline=None)
@given(sd=state_dicts, as_parameter=st.booleans())
def test_pickle_index_matches_torch_load(sd: dict, as_parameter: bool, tmp_path_factory) -> None:
    from ckptkit.formats.pickle_index import read_index

    path = tmp_path_factory.mktemp("pi") / "x.pth"
    saved = {
        k: torch.nn.Parameter(v, requires_grad=False) if as_parameter and v.is_floating_point() else v
        for k, v in sd.items()
    }
    saved["view"] = torch.arange(10, dtype=torch.int32)[2:7]  # a view into a larger storage
    torch.save(saved, path)
    index, _ = read_index(path)
    loaded = torch.load(path, weights_only=True)
    assert list(index) == list(loaded)
    for k, v in loaded.items():
        assert index[k].shape == tuple(v.shape) and index[k].dtype == str(v.dtype).removeprefix("torch.")


@pytest.mark.parametrize("path", ["hf/llama3", "meta/llama2-2rank", "hf-bin/llama2", "meta/mistral"])
def test_inspect_never_imports_torch(path: str) -> None:
    code = (
        "import sys; from ckptkit.inspection import inspect_path; "
        f"info = inspect_path({str(FIXTURES / path)!r}); "
        "assert info['model_type'] and info['tensors']; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
