"""Writing a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes it, streamed.

Header, key/value metadata and tensor infos are encoded by the ``gguf`` package's
:class:`gguf.GGUFWriter` from shapes and types alone; tensor bytes are then written at
their offsets one tensor at a time, a chunk of rows at a time (read from the source's
files and converted with numpy where they lie there as stored, :mod:`.rows`; else cast
through float32 with torch), never the whole model in memory.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, note
from ckptkit.formats.gguf.model import assumed_fields
from ckptkit.formats.gguf.params import add_parameters
from ckptkit.formats.gguf.quants import quantized_chunks
from ckptkit.formats.gguf.rows import ChunkBuffers, row_chunks
from ckptkit.formats.gguf.tensors import GGUFTensor, hf_hparams, model_tensors, spec_of
from ckptkit.formats.gguf.vocab import add_vocab, no_tokenizer
from ckptkit.io import ALIGN, OutputFile, Overlap, SpanReader, copy_file, direct_pays, is_dir, publishing_file

if TYPE_CHECKING:
    from ckptkit.formats.base import OpenedCheckpoint


@contextmanager
def hf_folder(ckpt: OpenedCheckpoint, hparams: dict[str, Any]) -> Iterator[Path]:
    """The tokenizer side of the source as an HF folder: the source itself when it is one,
    else a temporary folder with what ``--to hf`` would write beside the weights."""
    if ckpt.raw.config_name == "config.json" and ckpt.path.is_dir() and ckpt.side_folder == ckpt.path:
        yield ckpt.path
        return
    if ckpt.raw.config_name == "config.json" and is_dir(ckpt.path):  # not on this disk: its files copied here
        with tempfile.TemporaryDirectory(prefix="ckptkit-gguf-") as tmp:
            folder = Path(tmp) / ckpt.path.name
            folder.mkdir()
            extra = getattr(ckpt, "extra_files", None)
            for src in [ckpt.path / "config.json", *(extra() if extra is not None else [])]:
                copy_file(src, folder / src.name)
            try:
                yield folder
            except CkptkitError as e:  # named by the source, not this temporary folder
                raise CkptkitError(str(e).replace(str(folder), str(ckpt.path))) from None
        return
    from ckptkit.formats.registry import get_format

    plan = get_format("hf").tokenizer(ckpt)
    with tempfile.TemporaryDirectory(prefix="ckptkit-gguf-") as tmp:
        folder = Path(tmp) / model_name(ckpt.path)
        folder.mkdir()
        extra = getattr(ckpt, "extra_files", None)
        for src in extra() if extra is not None else []:
            if src.name not in plan.skip:
                copy_file(src, folder / src.name)
        for name, data in plan.files.items():
            (folder / name).write_bytes(data)
        ids = {k: v for k, v in plan.ids.items() if hparams.get(k) is None and v is not None}
        (folder / "config.json").write_text(json.dumps({**hparams, **ids}, indent=2), encoding="utf-8")
        if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            raise no_tokenizer(ckpt.path)  # named by the source, not this temporary folder
        yield folder


@contextmanager
def quiet_gguf() -> Iterator[None]:
    """The gguf package logs llama.cpp's conversion chatter as warnings; not ours to show."""
    import logging

    logger = logging.getLogger("gguf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_name(path: Path) -> str:
    """A checkpoint's name as llama.cpp's converters take it: its folder's, or its file's stem."""
    return path.name if is_dir(path) else path.stem


def _not_kept(hparams: dict[str, Any], spec: Any) -> list[str]:
    """Notes on config.json fields the GGUF has no key for whose values are not the ones
    llama.cpp assumes: it will not run the source's model."""
    lost = [
        f"{field} {hparams[field]} (llama.cpp assumes {value})"
        for field, value in assumed_fields(spec, hparams).items()
        if hparams.get(field) is not None and hparams[field] != value
    ]
    if not lost:
        return []
    fact = f"GGUF has no key for {', '.join(lost)}: llama.cpp's outputs will differ from the source's"
    return [note(fact, "to keep the source's model, convert to a format other than gguf")]


def _check_vocab_rows(folder: Path, tensors: list[Any]) -> None:
    """Refuse what llama.cpp would write with embedding rows dropped: a byte-level BPE
    tokenizer (no ``tokenizer.model``) with fewer tokens than the embeddings have rows."""
    if (folder / "tokenizer.model").is_file() or not (folder / "tokenizer.json").is_file():
        return
    from ckptkit.formats.base import read_json

    doc = read_json(folder / "tokenizer.json")[1]
    n = len((doc.get("model") or {}).get("vocab") or {}) + len(doc.get("added_tokens") or [])
    rows = next((t.shape[0] for t in tensors if t.name == "token_embd.weight"), 0)
    if n < rows:
        raise CkptkitError(
            f"{folder / 'tokenizer.json'}: llama.cpp keeps only the first {n} of the {rows} embedding rows "
            "(as many as the tokenizer has tokens); ckptkit does not write a GGUF that cannot convert back whole"
        )


NARROWING = ("float16", "bfloat16")  # --dtype casts that can overflow or flush a value
WRITES_IN_FLIGHT = 1  # chunks written on the worker thread while the next is made


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _chunks(t: GGUFTensor, checked: bool, reader: SpanReader, buffers: ChunkBuffers) -> Iterable[bytes | memoryview]:
    """``t``'s GGML bytes a chunk at a time: from the source's bytes with numpy where they lie
    there as stored (:mod:`~ckptkit.formats.gguf.rows`, read by ``reader`` into ``buffers``),
    else through torch (``checked``: a narrowing cast that overflows or flushes a value is
    an error naming ``t``)."""
    import gguf

    if t.source is not None:
        chunks = row_chunks(t.source, gguf.GGMLQuantizationType(t.qtype).name, t.heads, reader, buffers)
        if chunks is not None:
            return chunks
    return quantized_chunks(t.make(), t.qtype, t.name if checked else None)


def _write(out: OutputFile, chunk: bytes | memoryview, offset: int) -> str:
    out.write(chunk, offset)
    return "write"


def planned_writer(arch: str, tensors: list[GGUFTensor]) -> Any:
    """A ``gguf.GGUFWriter`` for ``arch`` holding the tensor infos of ``tensors`` (shapes and
    types only: the bytes are streamed by :func:`publish`)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(None, arch)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)  # shape as given
    return w


def add_model_card(w: Any, folder: Path, fallback_name: str) -> None:
    """The ``general.*`` naming keys llama.cpp's converters take from ``folder`` (its
    config.json and README model card), with ``fallback_name`` and the size label it computes."""
    import gguf

    total, shared, expert, experts = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder, None, total)
    if meta.name is None:
        meta.name = fallback_name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, experts)
    meta.set_gguf_meta_model(w)


def publish(w: Any, tensors: list[GGUFTensor], dst: Path, force: bool, quiet: bool, checked: bool) -> int:
    """Write ``w``'s header, key/values and tensor infos, then each tensor's bytes at its
    offset a chunk at a time, into a temporary file beside ``dst``, fsynced and renamed onto
    it: ``dst`` is complete or absent. ``checked``: narrowing casts that overflow or flush a
    value are errors. Returns the file's size."""
    from ckptkit.progress import byte_progress

    size = sum(t.nbytes for t in tensors)
    with publishing_file(dst, force) as tmp:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        try:
            start = _aligned(fout.tell(), w.data_alignment)
        finally:
            fout.close()
            w.fout = None
        offsets = []
        for t in tensors:
            offsets.append(start)
            start = _aligned(start + t.nbytes, w.data_alignment)
        os.truncate(tmp, start)  # the padding: zeros
        out = OutputFile(tmp, direct=direct_pays(start))  # past the dirty limit: whole pages written direct
        reader = SpanReader()  # one for the file: source CRC-32s fed as read, every record checked at the end
        try:
            # each chunk is written on a worker thread while the next is read and converted:
            # WRITES_IN_FLIGHT chunks written while one more is made, each in its own buffers
            buffers = ChunkBuffers(WRITES_IN_FLIGHT + 1)
            with byte_progress("converting", size, quiet) as bar, Overlap(1, WRITES_IN_FLIGHT, bar.advance) as writes:
                for t, offset in zip(tensors, offsets, strict=True):  # in file order (see docs/formats.md)
                    written = 0
                    buffers.lead = offset % ALIGN  # each chunk made where its pages can go direct
                    for chunk in _chunks(t, checked, reader, buffers):
                        nbytes = memoryview(chunk).nbytes
                        writes.submit(functools.partial(_write, out, chunk, offset + written), nbytes)
                        written += nbytes
                        buffers.lead = (offset + written) % ALIGN
                    if written != t.nbytes:
                        raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            reader.close()  # every source record read is checked before the file is published
        except BaseException:
            reader.close(check=False)
            raise
        finally:
            out.close()
    return dst.stat().st_size


def write_gguf(
    ckpt: OpenedCheckpoint,
    dst: Path,
    dtype: str | None,
    quiet: bool = True,
    force: bool = False,
    allow_lossy: bool = False,
) -> int:
    """Write ``ckpt`` as the GGUF file ``dst``, as llama.cpp's converter would; returns its size.

    Header, metadata and tensor infos come first, from shapes and types; then each tensor's
    bytes. The file is written beside ``dst`` under a temporary name, fsynced, and renamed
    into place: ``dst`` is complete or absent.
    """
    import gguf

    if dst.suffix != ".gguf":
        raise CkptkitError(f"{dst}: a GGUF destination is a file path ending in .gguf")
    spec = spec_of(ckpt.family, ckpt.path)
    hparams = hf_hparams(ckpt)
    tensors, ftype = model_tensors(ckpt, hparams, dtype)
    ckpt.notes.extend(_not_kept(hparams, spec))
    w = planned_writer(spec.arch, tensors)
    with hf_folder(ckpt, hparams) as folder, quiet_gguf():
        w.add_type(gguf.GGUFType.MODEL)
        if spec.embeddings_to_vocab:
            _check_vocab_rows(folder, tensors)
        add_model_card(w, folder, model_name(ckpt.path))
        add_parameters(w, spec.parameters, hparams, ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        ckpt.notes.extend(add_vocab(w, spec.vocab, folder, hparams))
    return publish(w, tensors, dst, force, quiet, dtype in NARROWING and not allow_lossy)
