"""Help text fits an 80-column terminal: every line within 80 characters, every option
name whole, usage lines naming arguments as the docs do."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ckptkit.cli import app

COMMANDS = sorted(get_command(app).commands)  # type: ignore[attr-defined]


def _help(command: list[str]) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]], ids=lambda c: " ".join(c) or "ckptkit")
def test_help_fits_80_columns_with_every_option_whole(command: list[str]) -> None:
    text = _help(command)
    assert [line for line in text.splitlines() if len(line) > 80] == []
    assert "…" not in text
    if command:
        click_command = get_command(app).commands[command[0]]  # type: ignore[attr-defined]
        for param in click_command.params:
            for name in param.opts if param.param_type_name == "option" else []:
                assert re.search(rf"(^|[\s,]){re.escape(name)}(\s|,|$)", text, re.M), name


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("convert", "Usage: ckptkit convert [OPTIONS] SRC DST"),
        ("verify", "Usage: ckptkit verify [OPTIONS] A B"),
        ("inspect", "Usage: ckptkit inspect [OPTIONS] PATH"),
        ("run", "Usage: ckptkit run [OPTIONS] RECIPE [KEY=VALUE...]"),
        ("cp", "Usage: ckptkit cp [OPTIONS] NAME DEST"),
        ("merge", "Usage: ckptkit merge [OPTIONS] BASE ADAPTER DST"),
        ("generate", "Usage: ckptkit generate [OPTIONS] CHECKPOINT"),
    ],
)
def test_usage_line_names_arguments_as_the_docs_do(command: str, usage: str) -> None:
    text = _help([command])
    assert text.splitlines()[0] == usage
    assert "<bool>" not in text and "{" not in text.splitlines()[0]
