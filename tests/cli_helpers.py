"""The ``ckptkit`` command line run by tests: in this process (typer's ``CliRunner``), or as
a ``python -m ckptkit`` process of its own where the test is about the process (imports,
exit codes, signals).

A process pays 2-4 s of imports (torch, transformers) before it parses its arguments; the
in-process run pays none and gives the same exit code, stdout and stderr, with the warnings
a process would print on stderr added to it (Python's default filters), so that a stray
warning still breaks a test's "one line on stderr". An uncaught exception is raised, with
its traceback, where a process would print it.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

# Python's default warning filters (without -W or -X dev), most specific last
DEFAULT_IGNORED = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def ckptkit_in_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``ckptkit ARGS`` through the CLI's entry point in this process, as a finished process."""
    from typer.testing import CliRunner

    from ckptkit.cli import app

    argv = [str(a) for a in args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for category in DEFAULT_IGNORED:
            warnings.simplefilter("ignore", category)
        result = CliRunner().invoke(app, argv, prog_name="ckptkit")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return subprocess.CompletedProcess(["ckptkit", *argv], result.exit_code, result.stdout, result.stderr + shown)


def ckptkit_process(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m ckptkit ARGS`` as a user runs it."""
    cmd = [sys.executable, "-m", "ckptkit", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
