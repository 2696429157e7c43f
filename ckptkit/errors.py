"""The one user-facing error type (the CLI prints its message as one line and exits 1),
and notes: what the user should know about a result that is not an error."""

from __future__ import annotations

NOTHING_TO_DO = "nothing to do"  # an action, only where a user would otherwise act


def note(fact: str, action: str | None = None) -> str:
    """A note: ``"<fact>"``, or ``"<fact>; <action>"`` where something needs doing, ``action``
    starting with "to ..." (what for, then what to do). A note asks for action only when
    action is needed; :data:`NOTHING_TO_DO` as the action only where saying so is the point."""
    return f"{fact}; {action}" if action else fact


class CkptkitError(Exception):
    """A problem with the user's input (file, flag or config), explained in one line."""


class UnknownModel(CkptkitError):
    """The files (or ``--model-type``) do not say which model they hold, or say one ckptkit
    does not know: ``inspect`` still lists what is there."""


class ConfigError(CkptkitError):
    """A training config's key is unknown, missing or wrong (``config key x: ...``): the CLI
    says which config file, and that the overrides count."""


class FlagError(CkptkitError):
    """Command-line options that contradict each other or the target: bad usage (exit 2), in one line."""


class NoMetaLayout(CkptkitError):
    """The model family has no Meta layout (nor a DCP one of Meta's names); the formats
    layer adds the formats that do write it."""


class WriteError(CkptkitError, OSError):
    """An OS error while writing a destination (disk full, permission denied...), in one
    line naming the destination; still an OSError for callers that catch those."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
