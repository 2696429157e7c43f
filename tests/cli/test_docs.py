"""The docs cannot rot: every command block in README.md and docs/cli.md runs against the
bundled fixtures, every synopsis names only options the CLI has (docs/cli.md: all of them),
CI runs the README's test command, and measured numbers live only in the reports the
benchmarks write (docs/bench/)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import ckptkit_in_process
from typer.main import get_command

from ckptkit.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "cli.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
INSTALL = re.compile(r"^pip install torch==2\.13\.0 -e (\.|'\.\[test\]') && ")
VENV = "python3 -m venv .venv && . .venv/bin/activate"
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest"


def _blocks(path: Path, shell: bool) -> list[str]:
    return [
        body for lang, body in FENCE.findall(path.read_text()) if (lang in ("bash", "sh")) == shell and lang != "yaml"
    ]


def _commands(path: Path) -> list[str]:
    """The command lines of the shell blocks: comments dropped, one string per line."""
    lines = [line.split("  #")[0].strip() for block in _blocks(path, shell=True) for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_has_the_two_quickstart_commands_and_ci_runs_the_test_one() -> None:
    commands = _commands(ROOT / "README.md")
    installs = [c for c in commands if INSTALL.match(c)]
    assert len(installs) == 2 and installs[1] == TEST_COMMAND, installs
    assert installs[0].startswith("pip install torch==2.13.0 -e . && ckptkit convert fixtures/")
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def _runnable() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for command in _commands(path):
            if command == VENV or command == TEST_COMMAND:
                continue  # the environment the others run in; CI runs the test command itself
            out.append((path.name, INSTALL.sub("", command)))
    return out


@pytest.mark.slow
def test_documented_commands_run_on_the_bundled_fixtures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in order, from a folder that sees the repository's fixtures, as a user would from
    the repository root (outputs land in the temporary folder): the first line by bash with
    the ``ckptkit`` console script, the others' ``ckptkit`` commands in this process
    (tests/cli_helpers.py), each exiting 0."""
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "COLUMNS": "80"}
    commands = _runnable()
    assert len(commands) >= 6
    (where, first), *rest = commands
    res = subprocess.run(["bash", "-ec", first], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, f"{where}: {first}\n{res.stdout}\n{res.stderr}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    for where, command in rest:
        for part in command.split(" && "):
            argv = shlex.split(part)
            assert argv[0] == "ckptkit" and "|" not in argv and ";" not in part, command  # nothing else is documented
            proc = ckptkit_in_process(*argv[1:])
            assert proc.returncode == 0, f"{where}: {command}\n{proc.stdout}\n{proc.stderr}"
    assert shlex.split(first)[0] == "ckptkit", first


def _synopses(path: Path) -> dict[str, list[str]]:
    """command -> the option names its synopsis lines (plain code blocks) show."""
    found: dict[str, list[str]] = {}
    for block in _blocks(path, shell=False):
        current = None
        for line in block.splitlines():
            words = line.split()
            if words[:1] == ["ckptkit"] and len(words) > 1:
                current = words[1] if not words[1].startswith("-") else None
                found.setdefault(current or "", [])
            elif not line.startswith(" "):
                current = None
            if current is not None:
                found[current] += re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split("  #")[0])
    found.pop("", None)
    return found


def _options(command: str) -> set[str]:
    click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
    return {o for p in click_command.params if p.param_type_name == "option" for o in p.opts if o.startswith("--")}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_synopses_name_only_real_options(path: Path) -> None:
    synopses = _synopses(path)
    assert synopses
    for command, shown in synopses.items():
        assert set(shown) <= _options(command) | {"--help"}, (command, set(shown) - _options(command))


def test_cli_md_synopses_show_every_option() -> None:
    for command, shown in _synopses(ROOT / "docs" / "cli.md").items():
        assert _options(command) - {"--help"} <= set(shown), (command, _options(command) - set(shown))


# Measured quantities: ratios, durations, rates, shares of time. Code spans and fenced
# blocks are left out (flags, defaults, sample output); docs/bench/ is what the benches write.
MEASURED = re.compile(
    r"(?<![\w.-])\d+(\.\d+)?x\b|(?<![\w.-])\d+(\.\d+)?\s?(s|ms|sec|seconds|min|minutes)\b"
    r"|\d\s?([KMGT]i?B|tokens)/s\b|\d\s?%"
)


def _prose(path: Path) -> list[tuple[int, str]]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    return [(i, re.sub(r"`[^`]*`", "", line)) for i, line in enumerate(text.splitlines(), 1)]


def test_measured_numbers_live_only_in_bench_reports() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in docs for i, line in _prose(p) if MEASURED.search(line)
    ]
    assert found == []


def test_bench_reports_say_which_command_wrote_them() -> None:
    reports = sorted((ROOT / "docs" / "bench").glob("*.md"))
    assert reports
    for report in reports:
        head = report.read_text().splitlines()[:3]
        match = re.search(r"Written by `python (bench/\w+\.py)[^`]*`", "\n".join(head))
        assert match, report
        assert (ROOT / match.group(1)).is_file() and "reporting(" in (ROOT / match.group(1)).read_text()


def test_measured_pattern_catches_what_it_is_for() -> None:
    for claim in ["took 1.2x cp", "in 0.8 s", "at 1.4 GB/s", "7-13% of the run", "27834 tokens/s"]:
        assert MEASURED.search(claim), claim
    for fact in ["a 4 KiB sample", "Llama-2-7B", "bf16", "CRC-32", "step 500", "Python 3.11", "CRC-32s"]:
        assert not MEASURED.search(fact), fact


SUITE_TIME = re.compile(r"<!-- suite-time -->`([^`]*)`<!-- /suite-time -->")


def _suite_figure(report: Path) -> str:
    """The one line in the text block of a report bench/suite.py wrote."""
    (body,) = [b for lang, b in FENCE.findall(report.read_text()) if lang == "text"]
    (line,) = body.strip().splitlines()
    return line


def test_the_readme_quotes_the_suite_time_ci_wrote() -> None:
    (quoted,) = SUITE_TIME.findall((ROOT / "README.md").read_text())
    assert quoted == _suite_figure(ROOT / "docs" / "bench" / "suite.md")
    assert re.fullmatch(r"\d+ tests in \d+ s \(\d+\.\d min\) on \d+ CPUs(; \.ci/run in all \d+ s)?", quoted)


def test_the_suite_script_writes_the_junit_figures_into_the_report_and_the_readme(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" '
        'tests="7" time="61.4"></testsuite></testsuites>'
    )
    readme = tmp_path / "README.md"
    readme.write_text("Takes <!-- suite-time -->`old`<!-- /suite-time -->.\n")
    report = tmp_path / "suite.md"
    cmd = [sys.executable, str(ROOT / "bench" / "suite.py"), "--junit", str(tmp_path / "junit.xml"),
           "--readme", str(readme), "--report", str(report)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    line = f"7 tests in 61 s (1.0 min) on {os.cpu_count()} CPUs"
    assert _suite_figure(report) == line and report.read_text().startswith("Written by `python bench/suite.py ")
    assert readme.read_text() == f"Takes <!-- suite-time -->`{line}`<!-- /suite-time -->.\n"
