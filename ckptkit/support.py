"""The support matrix: which model types each format reads and writes, and what a
conversion into it does with the tokenizer, asked of the two registries (``ckptkit
support``; docs/support.md holds its output, and a test keeps the two the same)."""

from __future__ import annotations

from typing import Any

from ckptkit.formats import REGISTRY as FORMATS
from ckptkit.models import REGISTRY as FAMILIES


def support_matrix() -> dict[str, dict[str, dict[str, Any]]]:
    """model type -> format -> {"read", "write", "tokenizer"}."""
    matrix: dict[str, dict[str, dict[str, Any]]] = {}
    for name, family in FAMILIES.items():
        row = matrix[name] = {}
        for fmt_name, fmt in FORMATS.items():
            held = fmt.support(family)
            tokenizer = held.tokenizer if held.writes else "-"
            row[fmt_name] = {"read": held.reads, "write": held.writes, "tokenizer": tokenizer}
    return matrix


def _cell(entry: dict[str, Any]) -> str:
    what = [w for w in ("read", "write") if entry[w]]
    return " + ".join(what) if what else "no"


def support_markdown() -> str:
    """Two Markdown tables: read / write per model type and format, then the tokenizer."""
    matrix = support_matrix()
    formats = list(FORMATS)
    lines = [
        "| model type | " + " | ".join(f"`{f}`" for f in formats) + " |",
        "| --- |" + " --- |" * len(formats),
    ]
    for name, row in matrix.items():
        lines.append(f"| `{name}` | " + " | ".join(_cell(row[f]) for f in formats) + " |")
    lines += ["", "Tokenizer, when converting into each format:", ""]
    lines += ["| model type | " + " | ".join(f"`{f}`" for f in formats) + " |", "| --- |" + " --- |" * len(formats)]
    for name, row in matrix.items():
        lines.append(f"| `{name}` | " + " | ".join(row[f]["tokenizer"] for f in formats) + " |")
    return "\n".join(lines) + "\n"
