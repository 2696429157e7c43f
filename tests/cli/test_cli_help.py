"""Help text fits an 80-column terminal: every line within 80 characters, every option
name whole, usage lines naming arguments as the docs do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ckptkit.cli import app

COMMANDS = sorted(get_command(app).commands)  # type: ignore[attr-defined]


# Each command's --help in one process: the app's entry point run once per command, its
# stdout taken for each, the exit status with it.
HELPS = """
import contextlib, io, json, sys
from ckptkit.cli import app
found = {}
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            app([*command, "--help"], prog_name="ckptkit")
            code = 0
        except SystemExit as e:
            code = e.code or 0
    found[" ".join(command)] = [code, out.getvalue()]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """The help a user sees in an 80-column terminal, by command (a real process: click sizes
    its output from the terminal, not from what a test runner passes it); one process
    prints every command's."""
    env = {**os.environ, "COLUMNS": "80", "LINES": "24"}
    commands = json.dumps([[], *[[c] for c in COMMANDS]])
    result = subprocess.run([sys.executable, "-c", HELPS, commands], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    found = json.loads(result.stdout)
    assert all(code == 0 for code, _ in found.values()), found
    return {command: text for command, (_, text) in found.items()}


@pytest.mark.slow
def test_help_of_a_process_of_its_own_is_the_same(helps: dict[str, str]) -> None:
    """``python -m ckptkit convert --help`` prints what the one process printed for it."""
    env = {**os.environ, "COLUMNS": "80", "LINES": "24"}
    cmd = [sys.executable, "-m", "ckptkit", "convert", "--help"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, helps["convert"], "")


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]], ids=lambda c: " ".join(c) or "ckptkit")
def test_help_fits_80_columns_with_every_option_whole(command: list[str], helps: dict[str, str]) -> None:
    text = helps[" ".join(command)]
    assert [line for line in text.splitlines() if len(line) > 80] == []
    assert "…" not in text
    if command:
        click_command = get_command(app).commands[command[0]]  # type: ignore[attr-defined]
        for param in click_command.params:
            for name in param.opts if param.param_type_name == "option" else []:
                assert re.search(rf"(^|[\s,]){re.escape(name)}(\s|,|$)", text, re.M), name
            choices = _offered(command[0], param) if param.param_type_name == "option" else []
            block = _help_block(text, param.opts[0]) if choices else ""
            for choice in choices:
                assert re.search(rf"(^|\s){re.escape(choice)}[,.\s]", block), f"{choice} broken or missing: {block}"


def _help_block(text: str, opt: str) -> str:
    """An option's help entry, its wrapped lines joined by single spaces."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(opt))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("-")), len(lines))
    return " ".join(line.strip() for line in lines[start:end]) + " "


def _offered(command: str, param: Any) -> list[str]:
    """The values the CLI accepts for an option, read from its refusal of a bogus one
    ([] for an option that takes any value or none)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return []
    opt = param.opts[0]
    args = {"convert": ["convert", "a", "b", "--to", "hf"], "inspect": ["inspect", "a"]}.get(command, [command])
    result = CliRunner().invoke(app, [*args, opt, "bogus-value"], env={"COLUMNS": "2000"})
    found = re.search(r"bogus-value: not one of (.*?)(;|$)", " ".join(result.output.split()))
    return found.group(1).split(", ") if found else []


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
def test_usage_line_names_arguments_as_the_docs_do(command: str, usage: str, helps: dict[str, str]) -> None:
    text = helps[command]
    assert text.splitlines()[0] == usage
    assert "<bool>" not in text and "{" not in text.splitlines()[0]
