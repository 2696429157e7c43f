"""The support matrix: which model types each format reads and writes, what a conversion
into it needs of the checkpoint and does with the tokenizer, asked of the two registries
(``ckptkit support``; docs/support.md holds its output, and a test keeps the two the same)."""

from __future__ import annotations

from typing import Any

from ckptkit.formats import REGISTRY as FORMATS
from ckptkit.models import REGISTRY as FAMILIES

IF = " (if)"  # a write cell whose format needs something of the checkpoint: the conditions table says what


def support_matrix() -> dict[str, dict[str, dict[str, Any]]]:
    """model type -> format -> {"read", "write", "needs" (topic -> condition), "tokenizer"}."""
    matrix: dict[str, dict[str, dict[str, Any]]] = {}
    for name, family in FAMILIES.items():
        row = matrix[name] = {}
        for fmt_name, fmt in FORMATS.items():
            held = fmt.support(family)
            tokenizer = held.tokenizer if held.writes else "-"
            needs = held.needs if held.writes else {}
            row[fmt_name] = {"read": held.reads, "write": held.writes, "needs": needs, "tokenizer": tokenizer}
    return matrix


def _cell(entry: dict[str, Any]) -> str:
    what = [w for w in ("read", "write") if entry[w]]
    return (" + ".join(what) if what else "no") + (IF if entry["needs"] else "")


def _table(matrix: dict[str, dict[str, dict[str, Any]]], formats: list[str], cell: Any) -> list[str]:
    lines = ["| model type | " + " | ".join(f"`{f}`" for f in formats) + " |", "| --- |" + " --- |" * len(formats)]
    lines += [f"| `{name}` | " + " | ".join(cell(row[f]) for f in formats) + " |" for name, row in matrix.items()]
    return lines


def support_markdown() -> str:
    """Markdown tables: read / write per model type and format, what writing needs where a
    format needs something, then the tokenizer."""
    matrix = support_matrix()
    formats = list(FORMATS)
    lines = _table(matrix, formats, _cell)
    conditional = [f for f in formats if any(row[f]["needs"] for row in matrix.values())]
    if conditional:
        lines += ["", f"What a checkpoint needs to be written, where a cell above says{IF}:", ""]
        lines += _table(matrix, conditional, lambda e: "; ".join(f"{k}: {v}" for k, v in e["needs"].items()) or "-")
    lines += ["", "Tokenizer, when converting into each format:", ""]
    lines += _table(matrix, formats, lambda e: e["tokenizer"])
    return "\n".join(lines) + "\n"
