"""A family is one module: how to add a model family, executable.

The family below is defined here, outside ckptkit, as a family module would be: its config
fields (a dataclass), its GGUF spec, its config translation, and one ``register`` call.
Registered, it is detected from a config.json, converted HF -> internal -> HF bit for bit
and to GGUF like a built-in family; unregistered, it is gone. The fixture is made at run
time: the Llama 2 fixture with another ``model_type`` and one field of the family's own.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ckptkit.checkpoint import open_checkpoint
from ckptkit.convert import ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.models import ModelConfig, detect_from_hf, model_types, register, unregister
from ckptkit.models.llama import LLAMA_GGUF, Llama2, MetaFFN
from ckptkit.support import support_matrix

from conftest import FIXTURES, assert_same_files

# --- the family module ------------------------------------------------------------------------


@dataclass
class LlametteFields(MetaFFN):
    """Llama's own fields, plus one only this family has."""

    attention_temperature: float = 1.0


class Llamette(Llama2):
    """Llama 2 under another model type, with an attention temperature in its config.json."""

    name = "llamette"
    hf_model_types = ("llamette",)
    hf_architecture = "LlametteForCausalLM"
    fields: ClassVar[type[LlametteFields]] = LlametteFields
    tokenizer = None  # its tokenizer files are carried as they are
    gguf = dataclasses.replace(LLAMA_GGUF, hf_architectures=("LlametteForCausalLM",))  # llama.cpp's llama

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        model = super().config_from_hf(cfg)
        return model.replace_fields(attention_temperature=float(cfg.get("attention_temperature", 1.0)))

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
        out = super().config_to_hf(cfg, dtype)
        out["attention_temperature"] = cfg.fields(LlametteFields).attention_temperature
        return out


# --- the test -----------------------------------------------------------------------------------


@pytest.fixture
def llamette(tmp_path: Path) -> Iterator[Path]:
    """The family registered, and its HF fixture (Llama 2's weights and tokenizer)."""
    src = tmp_path / "llamette"
    shutil.copytree(FIXTURES / "hf" / "llama2", src)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="llamette", architectures=["LlametteForCausalLM"], attention_temperature=0.5)
    (src / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    register(Llamette())
    try:
        yield src
    finally:
        unregister(Llamette.name)


def test_a_registered_family_is_detected_and_converts_bitwise(llamette: Path, tmp_path: Path) -> None:
    assert model_types()[-1] == "llamette"
    assert all(support_matrix()["llamette"][f][rw] for f in ("hf", "internal", "gguf") for rw in ("read", "write"))
    with open_checkpoint(llamette) as ckpt:
        assert ckpt.family.name == "llamette"
        assert ckpt.config.fields(LlametteFields).attention_temperature == 0.5
        written = ckpt.family.config_to_hf(ckpt.config, "float32")
        assert (written["model_type"], written["attention_temperature"]) == ("llamette", 0.5)

    convert(llamette, tmp_path / "internal", ConvertOptions("internal"))
    doc = json.loads((tmp_path / "internal" / "ckptkit.json").read_text())
    assert doc["model_type"] == "llamette" and doc["config"]["attention_temperature"] == 0.5
    with open_checkpoint(tmp_path / "internal") as ckpt:
        assert ckpt.config.fields(LlametteFields).attention_temperature == 0.5
    convert(tmp_path / "internal", tmp_path / "back", ConvertOptions("hf"))
    assert_same_files(llamette, tmp_path / "back")


def test_a_registered_family_converts_to_gguf_as_llama_cpp_s_llama(llamette: Path, tmp_path: Path) -> None:
    """Its GGUF is llama.cpp's ``llama``: the same tensors, bytes and types as Llama 2's."""
    from gguf import GGUFReader

    convert(llamette, tmp_path / "llamette.gguf", ConvertOptions("gguf"))
    convert(FIXTURES / "hf" / "llama2", tmp_path / "llama2.gguf", ConvertOptions("gguf"))
    ours, theirs = GGUFReader(tmp_path / "llamette.gguf"), GGUFReader(tmp_path / "llama2.gguf")
    assert ours.fields["general.architecture"].contents() == "llama"
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors
    ]


def test_an_unregistered_family_is_gone(llamette: Path) -> None:
    config = json.loads((llamette / "config.json").read_text())
    assert detect_from_hf(config, "here").name == "llamette"
    unregister(Llamette.name)
    try:
        with pytest.raises(CkptkitError, match="unsupported model_type 'llamette'"):
            detect_from_hf(config, "here")
        assert "llamette" not in model_types()
    finally:
        register(Llamette())  # for the fixture to unregister


def test_a_name_is_registered_once(llamette: Path) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(Llamette())
