"""``inspect``'s tensor table in a terminal: every row on one line of its width, each tensor
name whole (copyable), the file column given up for per-file tables when it does not fit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import FIXTURES

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def stored(folder: Path) -> dict[str, list[str]]:
    """Weight file -> the tensor names it holds, read with safetensors itself."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found[path.name] = sorted(f.keys())
    return found


def terminal_inspect(folder: Path, columns: int) -> list[str]:
    env = {**os.environ, "COLUMNS": str(columns), "TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "ckptkit", "inspect", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return ANSI.sub("", proc.stdout).splitlines()


@pytest.mark.parametrize(("columns", "per_file"), [(80, True), (200, False)])
def test_tensor_names_stay_whole_at_the_terminal_width(columns: int, per_file: bool) -> None:
    folder = FIXTURES / "hf" / "qwen3_moe"  # names of 46 characters, two shards
    lines = terminal_inspect(folder, columns)
    table = lines[lines.index(next(line for line in lines if line.startswith("files "))) + 1 :]
    assert all(len(line) <= columns for line in table)
    rows = [line.split() for line in table if line.startswith(" ") and "[" in line]
    files = stored(folder)
    assert sorted(r[0] for r in rows) == sorted(n for names in files.values() for n in names)
    if per_file:  # a heading per file, its header row, then its tensors
        headings = [i for i, line in enumerate(table) if not line.startswith(" ")]
        assert [table[i] for i in headings] == [f"{f}:" for f in files]
        for i, end, f in zip(headings, [*headings[1:], len(table)], files, strict=True):
            assert sorted(line.split()[0] for line in table[i + 2 : end]) == files[f]
    else:
        assert all(r[-1] in files and r[0] in files[r[-1]] for r in rows)


def test_where_not_even_three_columns_fit_each_name_has_a_line_of_its_own() -> None:
    folder = FIXTURES / "hf" / "qwen3_moe"  # names of up to 46 characters: no table fits in 50
    lines = terminal_inspect(folder, 50)
    listing = lines[lines.index(next(line for line in lines if line.startswith("files "))) + 1 :]
    assert all(len(line) <= 50 for line in listing) and "…" not in "".join(listing)
    files = stored(folder)
    names = {n for found in files.values() for n in found}
    assert sorted(line for line in listing if line in names) == sorted(names)  # each whole, on its own line
    assert [line for line in listing if line.endswith(":")] == [f"{f}:" for f in files]
