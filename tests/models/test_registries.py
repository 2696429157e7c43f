"""The registries are the single source of formats and model families: the CLI and the
docs offer exactly what they hold, each format reads and writes its own checkpoints, and
nothing outside them branches on a format's name, a weight file's suffix or a family."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.convert import ConvertOptions, convert
from ckptkit.formats import REGISTRY as FORMAT_REGISTRY
from ckptkit.formats import containers, detect_format
from ckptkit.models import REGISTRY as FAMILY_REGISTRY
from ckptkit.verify import verify_paths

from conftest import FIXTURES, assert_same_layout

PACKAGE = Path(__file__).resolve().parents[2] / "ckptkit"


def _choices(args: list[str]) -> list[str]:
    """The choices the CLI offers, read from its own message for a value it rejects."""
    result = CliRunner().invoke(app, args, env={"COLUMNS": "2000"})
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    offered = re.search(r" bogus: not one of (.*?)(;|$)", text)
    assert offered, text
    return offered.group(1).split(", ")


@pytest.mark.parametrize("option", ["--to", "--from"])
def test_cli_format_choices_are_the_format_registry(option: str, tmp_path: Path) -> None:
    args = ["convert", str(tmp_path), str(tmp_path / "out"), "--to", "hf", option, "bogus"]
    assert _choices(args) == list(FORMAT_REGISTRY)


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_cli_model_type_choices_are_the_family_registry(command: str, tmp_path: Path) -> None:
    args = (
        ["convert", str(tmp_path), str(tmp_path / "out"), "--to", "hf"]
        if command == "convert"
        else ["inspect", str(tmp_path)]
    )
    assert _choices([*args, "--model-type", "bogus"]) == list(FAMILY_REGISTRY)


def _sources(under: Path, exclude: str | None = None) -> list[Path]:
    return [p for p in sorted(under.rglob("*.py")) if exclude is None or exclude not in p.parts]


def _matches(pattern: str, files: list[Path]) -> list[str]:
    rx = re.compile(pattern)
    return [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]


# Every registered format with a fixture of it (internal: made from the HF one). A format
# registered without an entry here fails test_every_format_has_a_fixture.
FORMAT_FIXTURES = {
    "meta": FIXTURES / "meta" / "llama2",
    "hf": FIXTURES / "hf" / "llama2",
    "hf-bin": FIXTURES / "hf-bin" / "llama2",
    "internal": None,
    "dcp": FIXTURES / "dcp" / "llama2",
    "dcp-titan": FIXTURES / "dcp-titan" / "llama2",
}


# Formats whose checkpoint is one file (made from the HF fixture, which they need not restore
# bit for bit: GGUF stores norms as float32).
ONE_FILE = {"gguf": "model.gguf"}


def test_every_format_has_a_fixture() -> None:
    assert sorted([*FORMAT_FIXTURES, *ONE_FILE]) == sorted(FORMAT_REGISTRY)


@pytest.mark.parametrize("name", list(ONE_FILE))
def test_each_one_file_format_writes_the_hf_fixture_and_reads_it_back(name: str, tmp_path: Path) -> None:
    dst = tmp_path / ONE_FILE[name]
    convert(FIXTURES / "hf" / "llama2", dst, ConvertOptions(name))
    assert dst.is_file() and detect_format(dst) is FORMAT_REGISTRY[name]
    convert(dst, tmp_path / "back", ConvertOptions("hf", dtype="bfloat16"))
    assert verify_paths(FIXTURES / "hf" / "llama2", tmp_path / "back").ok


@pytest.mark.parametrize("name", list(FORMAT_FIXTURES))
def test_each_format_detects_and_round_trips_its_own_checkpoint(name: str, tmp_path: Path) -> None:
    src = FORMAT_FIXTURES[name]
    if src is None:
        src = tmp_path / "src"
        convert(FIXTURES / "hf" / "llama2", src, ConvertOptions(name))
    assert detect_format(src) is FORMAT_REGISTRY[name]
    other = "internal" if name == "hf" else "hf"  # internal's own layout is its origin's, HF here
    convert(src, tmp_path / "mid", ConvertOptions(other))
    assert detect_format(tmp_path / "mid") is FORMAT_REGISTRY[other]
    convert(tmp_path / "mid", tmp_path / "back", ConvertOptions(name))
    assert detect_format(tmp_path / "back") is FORMAT_REGISTRY[name]
    assert_same_layout(src, tmp_path / "back")


def _documented_formats() -> list[str]:
    """The names in the first column of docs/cli.md's "Format names" table."""
    text = (PACKAGE.parent / "docs" / "cli.md").read_text()
    section = text.split("## Format names", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|\s*`([^`]+)`\s*\|", section, flags=re.MULTILINE)


def test_the_registry_holds_exactly_the_documented_formats() -> None:
    assert _documented_formats() == list(FORMAT_REGISTRY)


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    """The string constants an expression spells out: a literal, a tuple / list / set of
    them, or a module-level name bound to one of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e, constants)]
    if isinstance(node, ast.Name):
        return constants.get(node.id, [])
    return []


def format_branches(source: str, names: set[str], suffixes: tuple[str, ...]) -> list[int]:
    """Lines of ``source`` that compare something with a format name or a weight-file
    name or suffix (``==``, ``!=``, ``in``, ``is``, either side), or test a name with
    ``endswith`` / ``startswith`` / ``removesuffix`` against a weight-file suffix."""
    tree = ast.parse(source)
    constants: dict[str, list[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = _strings(stmt.value, {})

    def telling(nodes: list[ast.expr]) -> bool:
        return any(s in names or s.endswith(suffixes) for n in nodes for s in _strings(n, constants))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and telling([node.left, *node.comparators]):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("endswith", "startswith", "removesuffix")
            and telling(node.args)
        ):
            lines.append(node.lineno)
    return sorted(set(lines))


WEIGHT_SUFFIXES = (*containers.WEIGHT_SUFFIXES, containers.INDEX_SUFFIX)


def test_the_format_branch_check_catches_every_spelling() -> None:
    planted = """
SUFFIXES = ('.safetensors', '.bin')
def f(fmt, p, name, device, other):
    a = fmt == 'meta'
    b = "hf" != fmt
    c = fmt in {"meta", "internal"}
    d = fmt not in ["hf-bin"]
    e = p.suffix == ".pth"
    g = p.suffix in SUFFIXES
    h = name.endswith(".safetensors")
    i = name.endswith((".pt", ".gguf"))
    j = name == "model.safetensors.index.json"
    k = "hf" is fmt
    ok = (fmt == other, p.suffix == ".txt", name.endswith(".json"), device == "cpu", build(device="meta"))
"""
    assert format_branches(planted, set(FORMAT_REGISTRY), WEIGHT_SUFFIXES) == list(range(4, 14))


def test_no_format_name_or_suffix_branches_outside_formats() -> None:
    names = set(FORMAT_REGISTRY)
    found = [
        f"{p.relative_to(PACKAGE)}:{line}"
        for p in _sources(PACKAGE, exclude="formats")
        for line in format_branches(p.read_text(), names, WEIGHT_SUFFIXES)
    ]
    assert found == []


# Spellings outside formats/ that are not about a checkpoint format, and why.
NOT_FORMATS = {
    ("train/checkpointer.py", "recipe_state.pt"): "torchtune's recipe-state file name, read by torchtune users",
}
TORCH_DEVICE_CALLS = {"to", "device", "to_empty"}


def format_spellings(source: str, names: set[str], suffixes: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, text) of every string in ``source`` that spells a format name, a weight-file
    extension, or a file name with one (``"hf"``, ``"pth"``, ``"x.safetensors"``, in a
    literal, a list, a dict, an f-string or a message): wherever it ends up being compared,
    the knowledge belongs to a format. Not counted: docstrings, class-level data in a
    family (``meta_container = "pth"``), and torch's ``"meta"`` device."""
    tree = ast.parse(source)
    extensions = {s.lstrip(".") for s in suffixes if s.count(".") == 1}
    alternatives = "|".join(sorted(re.escape(e) for e in extensions))
    mentions = re.compile(rf"\.({alternatives})\b")
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            skip.add(id(first.value))  # a docstring
        if isinstance(node, ast.ClassDef):
            skip |= {id(s.value) for s in node.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)}
        if isinstance(node, ast.keyword) and node.arg == "device":
            skip.add(id(node.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TORCH_DEVICE_CALLS:
            skip |= {id(a) for a in node.args}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            if text in names or text in extensions or text.endswith(suffixes) or mentions.search(text):
                found.append((node.lineno, text))
    return sorted(found)


def test_the_spelling_check_catches_a_format_wherever_it_is_written() -> None:
    planted = """
class Family:
    meta_container = "pth"
def f(fmt, conf, device, model):
    \"\"\"Reads model.safetensors (a docstring may say so).\"\"\"
    expect = {"component": ["hf", "hf-bin"]}
    wanted = conf.get("formats", ['meta'])
    name = f"{fmt}.safetensors"
    ext = "pth"
    note = "save it as adapter_model.bin instead"
    model.to("meta")
    build(device="meta")
    torch.device("meta")
    return fmt in wanted
"""
    found = format_spellings(planted, set(FORMAT_REGISTRY), WEIGHT_SUFFIXES)
    assert [line for line, _ in found] == [6, 6, 7, 8, 9, 10], found


def test_no_format_spelled_outside_formats() -> None:
    names = set(FORMAT_REGISTRY)
    found = [
        f"{p.relative_to(PACKAGE)}:{line}: {text!r}"
        for p in _sources(PACKAGE, exclude="formats")
        for line, text in format_spellings(p.read_text(), names, WEIGHT_SUFFIXES)
        if (str(p.relative_to(PACKAGE)), text) not in NOT_FORMATS
    ]
    assert found == [], "ask the format registry instead (or add the spelling to NOT_FORMATS with why)"


def test_no_family_knowledge_outside_models() -> None:
    assert _matches(r"model_type\s*(==|!=|in\b)", _sources(PACKAGE / "train")) == []
    scaled = [m for m in _matches(r"use_scaled_rope", _sources(PACKAGE)) if not m.startswith("models/llama.py")]
    assert scaled == []


@pytest.mark.parametrize("command", [[], ["convert"], ["inspect"], ["verify"], ["run"], ["ls"], ["cp"], ["generate"]])
def test_dash_h_is_help(command: list[str]) -> None:
    runner = CliRunner()
    long, short = runner.invoke(app, [*command, "--help"]), runner.invoke(app, [*command, "-h"])
    assert long.exit_code == 0 and short.exit_code == 0
    assert short.output == long.output and "Usage" in long.output


def test_a_field_name_means_one_thing_across_families() -> None:
    """ckptkit.json and config.json are checked against every family's field checks at once
    (``fields.set_family_checks``), so a field one family checks (Llama 4's boolean
    ``multimodal``) must not name another family's field of another type (Qwen 3.5's wrapper
    config once did, and its DCP round trip was refused)."""
    import dataclasses

    from ckptkit.models.registry import REGISTRY

    checks: dict[str, tuple[str, object]] = {}
    for name, family in REGISTRY.items():
        for key, check in family.fields.all_checks().items():
            checks.setdefault(key, (name, check))
    clashes = []
    for name, family in REGISTRY.items():
        own = family.fields.all_checks()
        for f in dataclasses.fields(family.fields):
            if f.name in checks and checks[f.name][1] is not own.get(f.name):
                clashes.append(f"{name}.{f.name} (checked as {checks[f.name][0]}'s)")
    assert clashes == []
