"""The copy engine: tensor bytes moved file to file, written to disk, published atomically.

The rest of ckptkit imports only the names below. The modules import each other in one
direction, bottom first (``docs/architecture.md``)::

    source     SourceFile: what every reader reads through; open_source(path), the one
               place that opens a source (a local file, or one mounted from elsewhere)
    spans      Span, RecordCheck and the arithmetic of span lists (no I/O)
    crc        crc32: zip's CRC-32, zlib-ng's where installed (no I/O)
    stream     the reused buffer, positioned reads and writes, the stream pass
    records    recorded CRC-32s of a source's zip records (Verifier), read_spans
    direct     O_DIRECT writes of whole pages, direct_pays
    transfer   transfer() of a span list, its fallbacks, OutputFile
    overlap    Overlap: copies on worker threads            (imports none of the above)
    publish    publishing(): temp folder, DST lock, fsync, rename (imports none of the above)

Users choose a copy method among :data:`COPY_METHODS` (``auto``, ``direct``, ``stream``);
the fallbacks (``gather``, ``copy_file_range``, ``sendfile``, ``readwrite``) are chosen by
:func:`~ckptkit.io.transfer.transfer` itself and logged on the ``ckptkit.io`` logger.
"""

from __future__ import annotations

from ckptkit.io.crc import crc32
from ckptkit.io.direct import ALIGN, direct_pays
from ckptkit.io.overlap import DEPTH, Overlap
from ckptkit.io.publish import (
    Stopped,
    check_replaceable,
    publishing,
    publishing_file,
    retire,
    signal_of,
    stopped_by,
    stopping_on_signals,
    sweep,
    tmp_beside,
)
from ckptkit.io.records import SpanReader, Verifier, read_spans
from ckptkit.io.source import (
    LocalFile,
    SourceFile,
    Window,
    all_local,
    copy_file,
    entries,
    exists,
    is_dir,
    is_file,
    is_local,
    mounted,
    open_source,
    read_at,
    read_file,
    read_fully,
    size_of,
)
from ckptkit.io.spans import RecordCheck, Rows, Span, coalesce, take, take_ranges, take_rows, total_bytes
from ckptkit.io.transfer import AUTO, COPY_METHODS, DIRECT, STREAM, OutputFile

__all__ = [
    # the source files, wherever they are
    "SourceFile", "LocalFile", "open_source", "mounted", "Window", "read_at", "read_fully", "read_file", "copy_file",
    "entries", "exists", "is_dir", "is_file", "is_local", "all_local", "size_of",
    # where a tensor's bytes lie in the source
    "Span", "Rows", "RecordCheck", "Verifier", "coalesce", "take", "take_ranges", "take_rows", "total_bytes",
    "read_spans", "SpanReader", "crc32",
    # writing them
    "AUTO", "COPY_METHODS", "DIRECT", "STREAM", "OutputFile", "Overlap", "DEPTH", "direct_pays", "ALIGN",
    # putting the output in place
    "publishing", "publishing_file", "check_replaceable", "retire", "sweep",
    "tmp_beside",
    # stopping: SIGTERM and SIGHUP as Ctrl-C
    "Stopped", "stopping_on_signals", "stopped_by", "signal_of",
]  # fmt: skip
