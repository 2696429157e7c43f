"""What the data pipeline produces and the step consumes: tokenised samples and the label
that marks a position without loss. A leaf module, so :mod:`ckptkit.train.data` and
:mod:`ckptkit.train.packing` both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

IGNORE_INDEX = -100


@dataclass
class Sample:
    """Token ids and labels (``IGNORE_INDEX`` where no loss), unshifted; ``lengths`` of packed documents."""

    ids: list[int]
    labels: list[int]
    lengths: list[int] = field(default_factory=list)
