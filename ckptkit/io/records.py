"""Recorded CRC-32s of a source's zip records, checked once each before their bytes are used,
and reads of spans into memory that check them first (or, for :class:`SpanReader`, on the
way, before the output is published)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ckptkit.errors import CkptkitError
from ckptkit.io.crc import crc32
from ckptkit.io.source import SourceFile, open_source, read_at
from ckptkit.io.spans import RecordCheck, Span
from ckptkit.io.stream import crc32_range, read_fully


class Verifier:
    """The recorded CRC-32s of one file's zip records, each checked once.

    The :class:`~ckptkit.io.spans.RecordVerifier` of :class:`~ckptkit.io.spans.RecordCheck`.
    ``fail(key)`` makes the exception a mismatch raises. A record is checked either by
    :meth:`feed` (the windows a stream copy reads, when they tile it in order) or by
    :meth:`verify` (reading it); :meth:`complete` reads whatever feeding did not cover.
    """

    def __init__(self, path: Path, fail: Callable[[str], Exception]) -> None:
        self.path = path
        self._fail = fail
        self._lock = threading.Lock()
        self._verified: set[str] = set()
        self._progress: dict[str, tuple[int, int]] = {}  # key -> (next offset, CRC so far)
        self._reading: dict[str, threading.Lock] = {}  # key -> held while a thread reads it

    def verified(self, key: str) -> bool:
        return key in self._verified

    def feed(self, check: RecordCheck, lo: int, view: memoryview) -> None:
        """Continue ``check``'s CRC with the bytes ``view`` holds from file offset ``lo``."""
        with self._lock:
            if check.key in self._verified:
                return
            nxt, crc = self._progress.get(check.key, (check.offset, 0))
        end = check.offset + check.size
        a, b = nxt, min(lo + len(view), end)
        if not lo <= a < b:
            return  # a gap or nothing new: complete() reads the record
        crc = crc32(view[a - lo : b - lo], crc)
        with self._lock:
            if self._progress.get(check.key, (check.offset, 0))[0] != nxt or check.key in self._verified:
                return  # another thread moved on meanwhile
            if b < end:
                self._progress[check.key] = (b, crc)
                return
            self._progress.pop(check.key, None)
        self.settle(check, crc)

    def complete(self, check: RecordCheck) -> None:
        if check.key not in self._verified:
            self.verify(check)

    def verify(self, check: RecordCheck) -> None:
        """Read the record and compare its CRC-32 (once per record: a thread that finds
        another reading it waits for that one)."""
        with self._lock:
            busy = self._reading.setdefault(check.key, threading.Lock())
        with busy:
            if check.key in self._verified:
                return
            src = open_source(self.path)
            try:
                got = crc32_range(src, check.offset, check.size)
            except EOFError:
                why = f"record data/{check.key} is cut short: the file is truncated"
                raise CkptkitError(f"{self.path}: {why}") from None
            finally:
                src.close()
            self.settle(check, got)

    def settle(self, check: RecordCheck, got: int) -> None:
        """Record the CRC-32 ``got`` of the whole record; raises if it is not the recorded one."""
        if got != check.crc:
            raise self._fail(check.key)
        with self._lock:
            self._verified.add(check.key)
            self._progress.pop(check.key, None)


def verify_checks(spans: Iterable[Span]) -> None:
    """Check every source record these spans draw on (each once per file)."""
    for span in spans:
        if span.check is not None:
            span.check.verifier.verify(span.check)


def read_spans(spans: list[Span]) -> bytes:
    """The bytes of ``spans``, read into memory (for small tensors), their records checked first."""
    verify_checks(spans)
    out = bytearray()
    for span in spans:
        src = open_source(span.path)
        try:
            out += read_at(src, span.offset, span.nbytes)
        except EOFError:
            raise EOFError(f"{span.path}: ends inside bytes {span.offset}..{span.offset + span.nbytes}") from None
        finally:
            src.close()
    return bytes(out)


class SpanReader:
    """Reads span lists into buffers, for a writer that converts bytes on the way.

    The CRC-32 of each source record the spans draw on is computed from the bytes as they
    are read, before :meth:`read_into` returns, when they come in order
    (:meth:`Verifier.feed`, as the stream copy does): a record whose last bytes were just
    read and fail its CRC-32 is raised there, before they are converted. (A writer that
    writes one chunk on another thread while it reads the next has the CRC run beside
    that write.) What was not read in order is read again by :meth:`close`, which checks
    every record seen: the output must not be published before it returns. Source files
    stay open until then.
    """

    def __init__(self) -> None:
        self._sources: dict[Path, SourceFile] = {}
        self._checks: dict[tuple[int, str], RecordCheck] = {}

    def read_into(self, spans: list[Span], view: memoryview) -> None:
        """Fill ``view`` (exactly as long as ``spans``) with their bytes."""
        at = 0
        for span in spans:
            if span.path not in self._sources:
                self._sources[span.path] = open_source(span.path)
            part = view[at : at + span.nbytes]
            try:
                read_fully(self._sources[span.path], part, span.offset)
            except EOFError:
                raise CkptkitError(f"{span.path}: changed while it was read (shorter than its size)") from None
            if span.check is not None:
                self._checks.setdefault((id(span.check.verifier), span.check.key), span.check)
                span.check.verifier.feed(span.check, span.offset, part)
            at += span.nbytes
        if at != len(view):
            raise ValueError(f"spans hold {at} bytes, the buffer {len(view)}")

    def close(self, check: bool = True) -> None:
        """Check every record read from (reading again what was not read in order) unless
        ``check`` is false (the reads were abandoned); close the files."""
        try:
            if check:
                for record in self._checks.values():
                    record.verifier.complete(record)
        finally:
            for src in self._sources.values():
                src.close()
            self._sources.clear()
            self._checks.clear()
