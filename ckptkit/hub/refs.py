"""Hub repository names as sources: ``org/name``, ``org/name@revision``, ``hf://org/name[@rev][/subfolder]``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckptkit.formats.hub_files import FILE_NAME_SUFFIXES

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_PLAIN = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^/@\s]+))?$")
_URI = re.compile(rf"^hf:/{{1,2}}(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^/@\s]+))?(?:/(?P<sub>[^@\s]+?))?/?$")


@dataclass(frozen=True)
class HubRef:
    """A model repository on the Hub, at a revision (None: its default branch), maybe a subfolder."""

    repo_id: str
    revision: str | None = None
    subfolder: str = ""

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.repo_id}{rev}/{self.subfolder}" if self.subfolder else f"{self.repo_id}{rev}"


def parse_ref(text: str | Path) -> HubRef | None:
    """The Hub repository ``text`` names, or None when it is a local path (one that exists here
    always wins) or not spelled as a repository."""
    raw = str(text)
    if Path(raw).exists() or raw.startswith(("/", "./", "../", "~")):
        return None
    if (m := _URI.match(raw)) is not None:  # hf:/ too: a pathlib.Path folds the // of hf://
        sub = (m["sub"] or "").strip("/")
        if any(part in ("", ".", "..") for part in sub.split("/")) and sub:
            return None
        return HubRef(m["repo"], m["rev"], sub)
    if (m := _PLAIN.match(raw)) is not None and not m["repo"].endswith(FILE_NAME_SUFFIXES):
        return HubRef(m["repo"], m["rev"])
    return None
