"""Source folders with symbolic links, fuzzed: loops (to itself, in pairs, to a folder above),
links out of the folder, dangling links and links that stay inside, at the top and in a
subfolder. ``inspect`` and ``convert`` either succeed or refuse in one line; never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptkit.cli import app

from conftest import FIXTURES

BASES = ["hf/llama2", "meta/llama2"]
# How a link is made: (what it points to, relative to the folder holding it), kind.
TARGETS = {
    "self": lambda name: name,  # ELOOP
    "pair": lambda name: f"{name}-twin",  # with a twin pointing back
    "up": lambda name: "..",  # out of the folder (a loop when walked)
    "outside": lambda name: "/etc/hostname",
    "dangling": lambda name: "no-such-file",
    "inside": lambda name: "config.json",
}


def make_links(root: Path, links: list[tuple[str, bool, str]]) -> None:
    for i, (kind, nested, name) in enumerate(links):
        folder = root / "sub" if nested else root
        folder.mkdir(exist_ok=True)
        link = folder / f"{name}{i}"
        if link.exists() or link.is_symlink():
            continue
        link.symlink_to(TARGETS[kind](link.name))
        if kind == "pair":
            (folder / f"{link.name}-twin").symlink_to(link.name)


def one_line_or_success(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    shown = f"{args}: exit {result.exit_code}\n{result.output}"
    assert result.exit_code in (0, 1), shown
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    if result.exit_code == 1:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
        return lines[0]
    return ""


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    base=st.sampled_from(BASES),
    links=st.lists(
        st.tuples(st.sampled_from(sorted(TARGETS)), st.booleans(), st.sampled_from(["x", "model.safetensors.x", "l"])),
        min_size=1,
        max_size=3,
    ),
)
def test_links_in_a_source_folder_are_one_line(
    tmp_path_factory: pytest.TempPathFactory, base: str, links: list[tuple[str, bool, str]]
) -> None:
    work = tmp_path_factory.mktemp("links")
    src = work / "src"
    shutil.copytree(FIXTURES / base, src)
    make_links(src, links)
    said = one_line_or_success(["inspect", str(src)])
    converted = one_line_or_success(["convert", str(src), str(work / "out"), "--to", "internal", "--quiet"])
    assert bool(said) == bool(converted), (said, converted)
    assert said or all(kind == "inside" or nested for kind, nested, _ in links), links
    shutil.rmtree(work)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("self", "x0: a symbolic link that cannot be followed"),
        ("pair", "a symbolic link that cannot be followed"),
        ("dangling", "x0: a symbolic link to no-such-file, which does not exist"),
        ("outside", "outside the checkpoint folder; refusing to follow it"),
    ],
)
def test_a_bad_link_is_named(tmp_path: Path, kind: str, said: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "hf/llama2", src)
    make_links(src, [(kind, False, "x")])
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out"), "--to", "meta"]):
        line = one_line_or_success(args)
        assert said in line and str(src) in line, line
    assert not (tmp_path / "out").exists()
