"""Where a tensor's bytes lie in its source: :class:`Span` lists and the arithmetic on them.

The bottom of :mod:`ckptkit.io`: plain data and pure functions, no I/O, importing nothing
from ckptkit. A tensor whose bytes a conversion only moves is described by a list of
spans (which file, where, how many bytes; concatenated in order): one span when it is
stored unchanged, row ranges when rows are permuted, split or joined.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

#: row indices: a list, or an integer array (the permutations of ckptkit.tensors.transforms)
Rows: TypeAlias = "Sequence[int] | npt.NDArray[np.integer]"


class RecordVerifier(Protocol):
    """Checks the recorded CRC-32s of one source file's zip records
    (:class:`ckptkit.io.records.Verifier`)."""

    def feed(self, check: RecordCheck, lo: int, view: memoryview) -> None:
        """Continue ``check``'s CRC with the bytes ``view`` holds from file offset ``lo``."""

    def complete(self, check: RecordCheck) -> None:
        """Check ``check`` now unless feeding it already did."""

    def verify(self, check: RecordCheck) -> None:
        """Read the record and check it (once per record)."""


@dataclass(frozen=True)
class RecordCheck:
    """A zip record whose recorded CRC-32 must hold before bytes of it are used."""

    verifier: RecordVerifier = field(compare=False)
    key: str
    offset: int  # where the record's data starts in the file
    size: int
    crc: int


@dataclass(frozen=True)
class Span:
    """``nbytes`` bytes of ``path`` from ``offset``: where one tensor's data lies.

    ``crc`` is the CRC-32 of exactly these bytes when the source file records it (a zip
    record holding the whole tensor), else None. ``check`` is the zip record the bytes lie
    in, whose CRC-32 must be checked before they are used (None: nothing to check).
    """

    path: Path
    offset: int
    nbytes: int
    crc: int | None = None
    check: RecordCheck | None = None

    def slice(self, start: int, nbytes: int) -> Span:
        """The sub-span of ``nbytes`` bytes from ``start`` within this one (no CRC unless whole)."""
        if start < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"slice {start}+{nbytes} outside a span of {self.nbytes} bytes")
        if start == 0 and nbytes == self.nbytes:
            return self
        return Span(self.path, self.offset + start, nbytes, None, self.check)


def coalesce(spans: list[Span]) -> list[Span]:
    """The same bytes in as few spans as possible (neighbours in one file merged)."""
    out: list[Span] = []
    for span in spans:
        if span.nbytes == 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.offset + last.nbytes == span.offset and _same_record(last, span):
            out[-1] = Span(last.path, last.offset, last.nbytes + span.nbytes, check=last.check)
        else:
            out.append(span)
    return out


def take_ranges(spans: list[Span], ranges: Iterable[tuple[int, int]]) -> list[Span]:
    """The byte ranges ``(start, nbytes)``, in order, of the concatenation of ``spans``."""
    starts = list(itertools.accumulate((s.nbytes for s in spans), initial=0))
    out: list[Span] = []
    for start, nbytes in ranges:
        end = start + nbytes
        if start < 0 or end > starts[-1]:
            raise ValueError(f"bytes {start}..{end} outside spans of {starts[-1]} bytes")
        i = bisect.bisect_right(starts, start) - 1
        while start < end:
            piece = min(end, starts[i + 1]) - start
            out.append(spans[i].slice(start - starts[i], piece))
            start += piece
            i += 1
    return out


def take(spans: list[Span], start: int, nbytes: int) -> list[Span]:
    """Bytes ``start`` .. ``start + nbytes`` of the concatenation of ``spans``."""
    return take_ranges(spans, [(start, nbytes)])


def take_rows(spans: list[Span], row_bytes: int, rows: Rows) -> list[Span]:
    """The rows ``rows`` (in that order; a list or an integer array) of a row-major tensor
    whose bytes are ``spans``, neighbours merged (as :func:`coalesce` would)."""
    if not row_bytes or not all(s.nbytes % row_bytes == 0 for s in spans):
        listed = [int(r) for r in rows]
        return coalesce(take_ranges(spans, ((r * row_bytes, row_bytes) for r in listed)))
    # each span whole rows (a tensor stored whole, or rows already reordered: Meta's Q/K):
    # rows located by arithmetic over arrays, one Span made per run of rows that lie end to
    # end in one record
    import numpy as np

    if len(rows) == 0:
        return []
    counts = np.fromiter((s.nbytes // row_bytes for s in spans), np.int64, len(spans))
    wanted = np.asarray(rows, np.int64)
    if not 0 <= int(wanted.min()) <= int(wanted.max()) < int(counts.sum()):
        raise ValueError(f"rows {wanted.min()}..{wanted.max()} outside a tensor of {counts.sum()} rows")
    records: dict[tuple[Path, RecordCheck | None], int] = {}
    record = np.fromiter((records.setdefault((s.path, s.check), len(records)) for s in spans), np.int64, len(spans))
    offset = np.fromiter((s.offset for s in spans), np.int64, len(spans))
    first_row = np.cumsum(counts) - counts
    which = np.repeat(np.arange(len(spans)), counts)[wanted]  # the span each wanted row lies in
    at = offset[which] + (wanted - first_row[which]) * row_bytes  # its file offset
    joined = (at[1:] == at[:-1] + row_bytes) & (record[which[1:]] == record[which[:-1]])
    bounds = [0, *(np.flatnonzero(~joined) + 1).tolist(), len(wanted)]
    out: list[Span] = []
    where, starts = which.tolist(), at.tolist()
    for i, j in itertools.pairwise(bounds):
        span, start, nbytes = spans[where[i]], starts[i], (j - i) * row_bytes
        whole = start == span.offset and nbytes == span.nbytes
        out.append(span if whole else Span(span.path, start, nbytes, check=span.check))
    return out


def _same_record(a: Span, b: Span) -> bool:
    return (a.path is b.path or a.path == b.path) and a.check == b.check


def total_bytes(spans: list[Span]) -> int:
    return sum(s.nbytes for s in spans)
