"""A damaged or crafted recorded layout (``ckptkit-origin.json``, the ``origin`` of
``ckptkit.json``) is never used, not even in part: the conversion succeeds with the target
format's own layout, exactly as without the record, and one note says the source layout will
not be restored and why. No path it names is ever written (``pwned``)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.convert import ConvertOptions, convert

from conftest import FIXTURES, tree_hashes

ORIGIN = "ckptkit-origin.json"
PWNED = "pwned"


def edited(edit: Callable[[dict], object]) -> Callable[[str], str]:
    def rewrite(text: str) -> str:
        doc = json.loads(text)
        edit(doc)
        return json.dumps(doc)

    return rewrite


def add_dotdot_tokenizer_file(doc: dict) -> None:
    files = doc["origin"]["tokenizer"]["files"]
    files[f"../{PWNED}"] = min(files.values())


# name -> (source fixture, format it is converted to first, how the record is damaged, the reason's words)
DAMAGE: dict[str, tuple[str, str, Callable[[str], str], str]] = {
    "not JSON": ("hf/llama2", "meta", lambda t: t[: len(t) // 2], "invalid JSON"),
    "not an object": ("hf/llama2", "meta", lambda t: "[1, 2]", "expected a JSON object"),
    "empty object": ("hf/llama2", "meta", lambda t: "{}", "no 'written' and 'origin' records"),
    "written a string": ("hf/llama2", "meta", edited(lambda d: d.update(written="x")), "no 'written'"),
    "other files": (
        "hf/llama2", "meta", edited(lambda d: d["written"]["files"].update({"consolidated.00.pth": 1})), "changed since"
    ),
    "files null": ("hf/llama2", "meta", edited(lambda d: d["origin"].update(files=None)), "(files)"),
    "index absolute path": (
        "hf/llama2", "meta", edited(lambda d: d["origin"]["index"].update(name=f"/tmp/{PWNED}")), "index name"
    ),
    "file dotdot": ("hf/llama2", "meta", edited(lambda d: d["origin"]["files"][0].update(name=f"../{PWNED}")), "../"),
    "tokenizer files null": (
        "hf/llama2", "meta", edited(lambda d: d["origin"]["tokenizer"].update(files=None)), "tokenizer files"
    ),
    "tokenizer file dotdot": (
        "hf/llama2", "meta",
        edited(add_dotdot_tokenizer_file),
        "../",
    ),
    "tokenizer file not packed": (
        "hf/llama2", "meta", edited(lambda d: d["origin"]["tokenizer"]["files"].update({"tokenizer.json": "{}"})),
        "recorded tokenizer file 'tokenizer.json'",
    ),
    "index text corrupt": (
        "hf/llama2", "meta",
        edited(lambda d: d["origin"]["index"].update(text='{"weight_map": {"x": "model-00009-of-00009.safetensors"}}')),
        "index",
    ),
    "archive name path": (
        "hf-bin/qwen2", "hf",
        edited(lambda d: d["origin"]["files"][0].update(archive={"archive": f"../{PWNED}", "serialization_id": "1"})),
        "archive of pytorch_model.bin",
    ),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_recorded_layout_is_one_note_and_the_conversion_succeeds(damage: str, tmp_path: Path) -> None:
    fixture, middle, rewrite, reason = DAMAGE[damage]
    back = fixture.split("/")[0]
    src = tmp_path / "work" / "src"
    convert(FIXTURES / fixture, src, ConvertOptions(middle))
    record = src / ORIGIN
    record.write_text(rewrite(record.read_text()))
    result = convert(src, tmp_path / "work" / "out", ConvertOptions(back))
    about = [n for n in result.notes if ORIGIN in n]
    assert len(about) == 1 and "\n" not in about[0], result.notes
    assert about[0].startswith(f"{record}: ") and reason in about[0]
    assert "the source layout it records will not be restored" in about[0]
    assert not list(tmp_path.rglob(f"*{PWNED}*"))
    plain = tmp_path / "plain"  # the same source without a record: what the output must be
    shutil.copytree(src, plain)
    (plain / ORIGIN).unlink()
    convert(plain, tmp_path / "plain-out", ConvertOptions(back))
    assert tree_hashes(tmp_path / "work" / "out") == tree_hashes(tmp_path / "plain-out")


def test_a_damaged_internal_origin_is_one_note(tmp_path: Path) -> None:
    src = tmp_path / "src"
    convert(FIXTURES / "hf/llama2", src, ConvertOptions("internal"))
    doc = json.loads((src / "ckptkit.json").read_text())
    doc["origin"]["config"]["name"] = f"/tmp/{PWNED}"
    (src / "ckptkit.json").write_text(json.dumps(doc))
    result = convert(src, tmp_path / "out", ConvertOptions("hf"))
    about = [n for n in result.notes if "ckptkit.json" in n]
    assert len(about) == 1 and "config name" in about[0] and "will not be restored" in about[0]
    assert not list(tmp_path.rglob(f"*{PWNED}*"))


def test_an_intact_record_restores_the_source_layout_without_a_note(tmp_path: Path) -> None:
    convert(FIXTURES / "hf/llama2", tmp_path / "meta", ConvertOptions("meta"))
    result = convert(tmp_path / "meta", tmp_path / "hf", ConvertOptions("hf"))
    assert result.plan.restored and not [n for n in result.notes if ORIGIN in n]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """hf/llama2 as Meta with its origin record, and its conversion back to HF without the record."""
    made = tmp_path_factory.mktemp("recorded")
    convert(FIXTURES / "hf/llama2", made / "meta", ConvertOptions("meta"))
    plain = made / "plain"
    shutil.copytree(made / "meta", plain)
    (plain / ORIGIN).unlink()
    convert(plain, made / "plain-hf", ConvertOptions("hf"))
    return made / "meta", made / "plain-hf"


@settings(max_examples=15, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_fuzzed_record_is_used_whole_or_not_at_all(
    data: st.DataObject, recorded: tuple[Path, Path], tmp_path: Path
) -> None:
    meta, plain_hf = recorded
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    src = work / "src"
    shutil.copytree(meta, src)
    text = bytearray((src / ORIGIN).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        text[data.draw(st.integers(0, len(text) - 1))] = data.draw(st.integers(0, 255))
    (src / ORIGIN).write_bytes(bytes(text))
    result = convert(src, work / "out", ConvertOptions("hf"))
    about = [n for n in result.notes if ORIGIN in n]
    assert len(about) <= 1
    if about:  # not used at all: the output is the conversion without a record
        assert "will not be restored" in about[0] and not result.plan.restored
        assert tree_hashes(work / "out") == tree_hashes(plain_hf)
