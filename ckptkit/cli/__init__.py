"""The ``ckptkit`` command line: thin wrappers that parse, call the library and render.

:mod:`ckptkit.cli.app` holds the Typer app and what every command shares; the commands
live in :mod:`~ckptkit.cli.checkpoints` (inspect, convert, verify, support) and
:mod:`~ckptkit.cli.training` (run, ls, cp, generate, merge), registered on import.
"""

from __future__ import annotations

from ckptkit.cli import checkpoints, training  # noqa: F401  (register their commands)
from ckptkit.cli.app import app

__all__ = ["app"]
