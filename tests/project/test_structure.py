"""The package's shape, as docs/architecture.md states it: layers that import only
downward, no import cycle, and the copy engine used only through its public face."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ckptkit"

# Bottom first; a module may import its own layer and the layers below it, never above.
LAYERS = [
    ["errors"],
    ["progress", "untrusted"],
    ["io"],
    ["tensors"],
    ["quant"],
    ["models"],
    ["tokenization"],
    ["formats"],
    ["checkpoint", "hub"],
    ["plan", "inspection", "support", "verify"],
    ["writing"],
    ["convert"],
    ["save_like"],
    ["train"],
    ["cli", "__main__", "__init__"],
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
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


def _graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported ckptkit module: line}, for every module of the package."""
    files = {_module(p, package): p for p in package.rglob("*.py")}
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


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a module from a higher layer than the importer's."""
    return [
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)}) at line {line}"
        for src, targets in graph.items()
        for dst, line in targets.items()
        if _layer(dst) > _layer(src)
    ]


def test_imports_only_go_down_the_layers() -> None:
    assert upward_imports(_graph()) == []


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


def private_io_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of a module inside ``ckptkit.io`` from outside it (the face is ``ckptkit.io``)."""
    return [
        f"{src} imports {dst}"
        for src, targets in graph.items()
        if not src.startswith("ckptkit.io")
        for dst in targets
        if dst.startswith("ckptkit.io.")
    ]


def test_the_copy_engine_is_used_through_its_public_face() -> None:
    assert private_io_imports(_graph()) == []


def _planted(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A small ``ckptkit`` package under ``tmp_path`` with these modules (path -> source)."""
    root = tmp_path / "ckptkit"
    for name, source in {"__init__.py": "", "io/__init__.py": "", **modules}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


def test_the_layer_check_finds_a_planted_upward_import(tmp_path: Path) -> None:
    root = _planted(
        tmp_path,
        {
            "tensors/casting.py": "def f():\n    from ckptkit.convert import convert\n",  # lazy, still upward
            "convert.py": "from ckptkit.tensors import casting\n",  # downward: fine
            "train/loop.py": "import ckptkit.cli.app\n",
            "cli/app.py": "",
        },
    )
    found = upward_imports(_graph(root))
    assert [f.split(" (")[0] + " -> " + f.split(" imports ")[1].split(" (")[0] for f in found] == [
        "ckptkit.tensors.casting -> ckptkit.convert",
        "ckptkit.train.loop -> ckptkit.cli.app",
    ]


def test_the_public_face_check_finds_a_planted_reach_inside(tmp_path: Path) -> None:
    root = _planted(
        tmp_path,
        {
            "io/stream.py": "",
            "io/publish.py": "from ckptkit.io.stream import x\n",  # inside the package: fine
            "convert.py": "from ckptkit.io import publishing\nfrom ckptkit.io.stream import copy_spans\n",
        },
    )
    assert private_io_imports(_graph(root)) == ["ckptkit.convert imports ckptkit.io.stream"]


def reaches_inside(graph: dict[str, dict[str, int]], package: str) -> list[str]:
    """Imports of ``package``'s modules from outside it (its ``__init__`` is its public face)."""
    return [
        f"{src} imports {dst}"
        for src, targets in graph.items()
        if src != package and not src.startswith(package + ".")
        for dst in targets
        if dst.startswith(package + ".")
    ]


def test_the_dcp_format_is_used_through_its_public_face() -> None:
    assert reaches_inside(_graph(), "ckptkit.formats.dcp") == []


def test_the_dcp_face_check_finds_a_planted_reach_inside(tmp_path: Path) -> None:
    root = _planted(
        tmp_path,
        {
            "formats/__init__.py": "",
            "formats/dcp/__init__.py": "from ckptkit.formats.dcp.folder import open_state\n",  # inside: fine
            "formats/dcp/folder.py": "",
            "train/distributed.py": "from ckptkit.formats.dcp import y\nfrom ckptkit.formats.dcp.folder import x\n",
        },
    )
    assert reaches_inside(_graph(root), "ckptkit.formats.dcp") == [
        "ckptkit.train.distributed imports ckptkit.formats.dcp.folder"
    ]


def test_one_conftest_for_all_test_folders() -> None:
    """Every tests/ folder is on sys.path (tests/conftest.py), so a second conftest.py would
    shadow the root one for every ``from conftest import ...``: fixtures of one folder live
    in a helper module its tests name in ``pytest_plugins``."""
    tests = PACKAGE.parent / "tests"
    assert sorted(p.relative_to(tests).as_posix() for p in tests.rglob("conftest.py")) == ["conftest.py"]
