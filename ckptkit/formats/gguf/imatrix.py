"""llama.cpp's importance matrix (``llama-quantize --imatrix FILE``), in either of its formats,
read as ``llama-quantize`` reads it: per tensor name, the mean squared activation of each
input column (each expert's own for 3-D expert tensors), as float32.

The GGUF format (``llama-imatrix``'s default): tensors ``NAME.in_sum2`` (sums) and
``NAME.counts`` (per expert), both F32, keys ``imatrix.datasets``, ``imatrix.chunk_count``,
``imatrix.chunk_size``; each value is its sum over its expert's count (rounded to an
integer; a count of 0 gives 1.0). The legacy ``.dat``: int32 entry count, then per entry
the name (int32 length, bytes), int32 call count, int32 value count, float32 values; then
optionally the int32 chunk count and the dataset (int32 length, bytes); each value is its
sum over the call count (as stored when that count is 0).

Bad files are one-line errors: unreadable layout, a NaN or infinite value (llama-quantize
refuses those), a file made for another model (no entry names one of its tensors, or an
entry's size is not the tensor's columns times its experts).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptkit.errors import CkptkitError

KEY_FILE = "quantize.imatrix.file"
KEY_DATASET = "quantize.imatrix.dataset"
KEY_ENTRIES = "quantize.imatrix.entries_count"
KEY_CHUNKS = "quantize.imatrix.chunks_count"
_GGUF_KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


@dataclass
class Imatrix:
    """One imatrix file: ``values`` per tensor name, the first dataset, the chunk count."""

    given: str  # the path as the user wrote it (llama-quantize records that)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    dataset: str | None = None
    chunks: int = 0

    def metadata(self) -> list[tuple[str, Any]]:
        """The keys llama-quantize adds after ``general.file_type``, in its order (strings
        cut at 127 bytes as its fixed buffers cut them)."""
        keys: list[tuple[str, Any]] = [(KEY_FILE, _cut(self.given))]
        if self.dataset is not None:
            keys.append((KEY_DATASET, _cut(self.dataset)))
        keys.append((KEY_ENTRIES, len(self.values)))
        if self.chunks > 0:
            keys.append((KEY_CHUNKS, self.chunks))
        return keys

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """A one-line error unless this imatrix is for the model of tensors ``shapes`` (the ones
        quantized, numpy order): some entry names one, and each such entry has its columns
        times its experts values (token embeddings excepted, as llama-quantize skips them)."""
        if not set(self.values) & set(shapes):
            raise CkptkitError(f"--imatrix {self.given}: none of its entries names a tensor of this model")
        for name, shape in shapes.items():
            got = self.values.get(name)
            want = shape[-1] * (shape[0] if len(shape) == 3 else 1)
            embeddings = name in ("token_embd.weight", "per_layer_token_embd.weight")
            if got is not None and got.size != want and not embeddings:
                raise CkptkitError(
                    f"--imatrix {self.given}: {got.size} values for {name}, which has {want} "
                    "columns (times experts): an imatrix of another model"
                )

    def weights(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The per-expert weights of tensor ``name`` ``(experts, columns)``, or None (no entry, or
        token embeddings of another size, which llama-quantize quantizes without)."""
        got = self.values.get(name)
        experts = shape[0] if len(shape) == 3 else 1
        if got is None or got.size != experts * shape[-1]:
            return None
        return got.reshape(experts, shape[-1])


def _cut(text: str) -> str:
    return text.encode()[:127].decode(errors="ignore")


def load_imatrix(path: str | Path) -> Imatrix:
    """The imatrix at ``path`` (GGUF or legacy, told by the GGUF magic)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CkptkitError(f"--imatrix {path}: cannot read it ({e.strerror or e})") from None
    out = _gguf(p, str(path)) if data[:4] == b"GGUF" else _legacy(data, str(path))
    for name, v in out.values.items():
        if not np.isfinite(v).all():
            raise CkptkitError(f"--imatrix {path}: entry {name} holds a NaN or infinite value")
    return out


def _gguf(p: Path, given: str) -> Imatrix:
    from ckptkit.formats.gguf.reader import read_header

    h = read_header(p)
    if not all(k in h.metadata for k in _GGUF_KEYS):
        raise CkptkitError(f"--imatrix {given}: a GGUF without the imatrix keys {', '.join(_GGUF_KEYS)}")
    datasets = h.metadata["imatrix.datasets"]
    out = Imatrix(given, chunks=int(h.metadata["imatrix.chunk_count"]))
    if isinstance(datasets, list) and datasets and h.types["imatrix.datasets"] == "array[string]":
        out.dataset = str(datasets[0])
    pairs: dict[str, dict[str, Any]] = {}
    for t in h.tensors:
        for suffix in (".in_sum2", ".counts"):
            if t.name.endswith(suffix) and t.name != suffix:
                pairs.setdefault(t.name.removesuffix(suffix), {})[suffix] = t
    if not pairs:
        raise CkptkitError(f"--imatrix {given}: a GGUF with no .in_sum2 / .counts tensors")
    with p.open("rb") as f:
        for name in sorted(pairs):
            sums, counts = pairs[name].get(".in_sum2"), pairs[name].get(".counts")
            if sums is None or counts is None or sums.kind != "F32" or counts.kind != "F32":
                raise CkptkitError(f"--imatrix {given}: entry {name} lacks F32 .in_sum2 and .counts tensors")
            s, c = _f32(f, sums.offset, sums.nbytes), _f32(f, counts.offset, counts.nbytes)
            if c.size == 0 or s.size % c.size:
                raise CkptkitError(f"--imatrix {given}: entry {name} has {s.size} sums for {c.size} counts")
            c64 = c.astype(np.float64)  # lround (halves away from zero), back to float as the C code divides
            n = (np.sign(c64) * np.floor(np.abs(c64) + 0.5)).astype(np.float32)
            per = s.reshape(c.size, -1)
            with np.errstate(all="ignore"):
                v = np.where(n[:, None] > 0, per / np.where(n > 0, n, 1)[:, None], np.float32(1))
            out.values[name] = v.astype(np.float32).reshape(-1)
    return out


def _f32(f: Any, offset: int, nbytes: int) -> np.ndarray:
    f.seek(offset)
    return np.frombuffer(f.read(nbytes), "<f4").copy()


def _legacy(data: bytes, given: str) -> Imatrix:
    out = Imatrix(given)
    pos = 0

    def take(fmt: str, what: str) -> Any:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise CkptkitError(f"--imatrix {given}: neither a GGUF nor a legacy imatrix (ends inside {what})")
        value = struct.unpack_from(fmt, data, pos)
        pos += size
        return value[0] if len(value) == 1 else value

    n_entries = take("<i", "the entry count")
    if n_entries < 1:
        raise CkptkitError(f"--imatrix {given}: neither a GGUF nor a legacy imatrix ({n_entries} entries)")
    for i in range(n_entries):
        length = take("<i", f"entry {i + 1}'s name")
        if not 0 <= length <= len(data) - pos:
            raise CkptkitError(f"--imatrix {given}: entry {i + 1}'s name length {length} is past the file")
        name = data[pos : pos + length].split(b"\0")[0].decode(errors="replace")
        pos += length
        ncall, nval = take("<i", f"entry {name}"), take("<i", f"entry {name}")
        if nval < 1 or pos + 4 * nval > len(data):
            raise CkptkitError(f"--imatrix {given}: entry {name} has {nval} values, not within the file")
        sums = np.frombuffer(data, "<f4", nval, pos).astype(np.float32)
        pos += 4 * nval
        with np.errstate(all="ignore"):
            out.values[name] = sums / np.float32(ncall) if ncall > 0 else sums
    if pos + 4 <= len(data):
        out.chunks = take("<i", "the chunk count")
        if pos + 4 <= len(data):
            length = take("<i", "the dataset")
            if 0 < length <= len(data) - pos:
                out.dataset = data[pos : pos + length].split(b"\0")[0].decode(errors="replace")
    return out
