"""The one user-facing error type: the CLI prints its message as one line and exits 1."""

from __future__ import annotations


class CkptkitError(Exception):
    """A problem with the user's input (file, flag or config), explained in one line."""


class WriteError(CkptkitError, OSError):
    """An OS error while writing a destination (disk full, permission denied...), in one
    line naming the destination; still an OSError for callers that catch those."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
