"""``--report PATH`` for every benchmark: what it prints also goes to a Markdown file whose
first line says which command wrote it, when, at which commit and on what machine.

docs/benchmarks.md links these files instead of quoting numbers, so a number in the docs
is always the output of a run anyone can repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent


def pop_report_argument() -> Path | None:
    """``--report PATH`` taken out of ``sys.argv`` (the benchmark's own parser never sees it)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--report", type=Path)
    known, rest = parser.parse_known_args(sys.argv[1:])
    sys.argv[1:] = rest
    return known.report


def _commit() -> str:
    res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "ckptkit", "bench"], capture_output=True
    )
    return (res.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty.stdout.strip() else "")


def header(script: str, argv: list[str]) -> str:
    command = shlex.join(["python", f"bench/{script}", *argv])
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return (
        f"Written by `{command}` on {when} at commit {_commit()} ({machine}).\nDo not edit: run the command again.\n\n"
    )


class _Tee:
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


@contextlib.contextmanager
def reporting(script: str) -> Iterator[None]:
    """With ``--report PATH`` on the command line, tee stdout into PATH after the header;
    the file appears only when the benchmark finishes."""
    argv = sys.argv[1:]
    path = pop_report_argument()
    if path is None:
        yield
        return
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w", encoding="utf-8") as f:
        f.write(header(script, argv))
        f.write("```text\n")
        saved, sys.stdout = sys.stdout, _Tee(sys.stdout, f)  # type: ignore[assignment]
        try:
            yield
        except SystemExit as done:  # a benchmark's sys.exit(main()): its verdict, not a crash
            if done.code not in (0, None):
                raise
        finally:
            sys.stdout = saved
        f.write("```\n")
    tmp.replace(path)
