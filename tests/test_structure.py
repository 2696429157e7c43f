"""The package's shape, as docs/architecture.md states it: layers that import only
downward, no import cycle, and the copy engine used only through its public face."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptkit"

# Bottom first; a module may import its own layer and the layers below it, never above.
LAYERS = [
    ["errors"],
    ["progress", "untrusted"],
    ["io"],
    ["tensors"],
    ["models"],
    ["tokenization"],
    ["formats"],
    ["checkpoint"],
    ["plan", "inspection", "support", "verify"],
    ["convert"],
    ["save_like"],
    ["train"],
    ["cli", "__main__", "__init__"],
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every ckptkit import in ``path``, at any depth (lazy ones too):
    ``from P import x`` gives ``P.x`` (a module, or a name in P that ``_graph`` trims)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ckptkit" or node.module.startswith("ckptkit."):
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("ckptkit.")]
    return found


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported ckptkit module: line}, for every module of the package."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        targets: dict[str, int] = {}
        for line, imported in _imports(path):
            while imported not in files and "." in imported:  # a name imported from a module
                imported = imported.rsplit(".", 1)[0]
            if imported in files and imported != name:
                targets.setdefault(imported, line)
        graph[name] = targets
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return LEVEL[parts[1] if len(parts) > 1 else "__init__"]


def test_every_top_level_module_and_package_has_a_layer() -> None:
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    names.discard("__pycache__")
    assert names - set(LEVEL) == set(), "give it a layer in LAYERS and in docs/architecture.md"
    assert set(LEVEL) - names == set()


def test_imports_only_go_down_the_layers() -> None:
    upward = [
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)}) at line {line}"
        for src, targets in _graph().items()
        for dst, line in targets.items()
        if _layer(dst) > _layer(src)
    ]
    assert upward == []


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_even_through_imports_inside_functions() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_the_copy_engine_is_used_through_its_public_face() -> None:
    inside = [
        f"{src} imports {dst}"
        for src, targets in _graph().items()
        if not src.startswith("ckptkit.io")
        for dst in targets
        if dst.startswith("ckptkit.io.")
    ]
    assert inside == []


def test_the_dcp_format_is_used_through_its_public_face() -> None:
    inside = [
        f"{src} imports {dst}"
        for src, targets in _graph().items()
        if not src.startswith("ckptkit.formats.dcp")
        for dst in targets
        if dst.startswith("ckptkit.formats.dcp.")
    ]
    assert inside == []
