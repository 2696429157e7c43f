"""The one user-facing error type: the CLI prints its message as one line and exits 1."""

from __future__ import annotations


class CkptkitError(Exception):
    """A problem with the user's input (file, flag or config), explained in one line."""
