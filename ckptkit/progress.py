"""A rich progress bar on stderr with bytes and throughput; silent when not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

stderr = Console(stderr=True)


def human(n: float) -> str:
    """Bytes for people: ``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class Bar:
    def __init__(self, progress: Progress | None, task: TaskID | None):
        self._progress, self._task = progress, task

    def advance(self, nbytes: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, nbytes)


@contextmanager
def byte_progress(description: str, total: int, quiet: bool = False) -> Iterator[Bar]:
    """A bar over ``total`` bytes; a no-op when quiet or stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield Bar(None, None)
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=False,
    ) as progress:
        yield Bar(progress, progress.add_task(description, total=total))
