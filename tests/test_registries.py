"""The registries are the single source of formats and model families: the CLI offers
exactly what they hold, and nothing outside them branches on a format's or family's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptkit.cli import app
from ckptkit.formats import REGISTRY as FORMAT_REGISTRY
from ckptkit.models import REGISTRY as FAMILY_REGISTRY

PACKAGE = Path(__file__).resolve().parent.parent / "ckptkit"


def _choices(args: list[str]) -> list[str]:
    """The choices the CLI offers, read from its own message for a value it rejects."""
    result = CliRunner().invoke(app, args, env={"COLUMNS": "2000"})
    assert result.exit_code == 2
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    offered = re.search(r"'bogus' is not one of (.*?)\.(\s|$)", text)
    assert offered, text
    return re.findall(r"'([^']+)'", offered.group(1))


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


def test_registered_names_match_their_objects() -> None:
    assert all(fmt.name == name for name, fmt in FORMAT_REGISTRY.items())
    assert all(family.name == name for name, family in FAMILY_REGISTRY.items())


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


def test_no_format_name_branches_outside_formats() -> None:
    names = "|".join(re.escape(n) for n in FORMAT_REGISTRY)
    pattern = rf'(==|!=)\s*"({names})"|in \(\s*"({names})"'
    assert _matches(pattern, _sources(PACKAGE, exclude="formats")) == []


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
