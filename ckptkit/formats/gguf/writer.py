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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, note
from ckptkit.formats.base import FilePlan, OpenedCheckpoint, Options, Plan, read_json_shared
from ckptkit.formats.gguf.hybrid import hybrid_hparams
from ckptkit.formats.gguf.imatrix import load_imatrix
from ckptkit.formats.gguf.in_flight import HeldBuffers, nothing, piece_jobs, streamed, write_then
from ckptkit.formats.gguf.mix import keep_types, kept_dtype, quantize_type
from ckptkit.formats.gguf.model import assumed_fields
from ckptkit.formats.gguf.params import add_parameters
from ckptkit.formats.gguf.quants import quantized_chunks
from ckptkit.formats.gguf.reader import PLAIN
from ckptkit.formats.gguf.rows import ChunkBuffers, row_chunks
from ckptkit.formats.gguf.tensors import (
    GGUFTensor,
    hf_hparams,
    hf_targets,
    left_out,
    model_tensors,
    spec_of,
)
from ckptkit.formats.gguf.vocab import ASKED, PRE_NAMES, RECORDED, add_vocab, no_tokenizer
from ckptkit.formats.registry import transformers_format
from ckptkit.formats.writers import FileWriter, Job
from ckptkit.io import ALIGN, DEPTH, SpanReader, copy_file, is_dir

if TYPE_CHECKING:
    import gguf
    import torch

    from ckptkit.models.gguf_spec import GGUFSpec
    from ckptkit.tensors.lazy import Lazy


@contextmanager
def hf_folder(ckpt: OpenedCheckpoint, hparams: dict[str, Any]) -> Iterator[Path]:
    """The tokenizer side of the source as an HF folder: the source itself when it is one,
    else a temporary folder with what ``--to hf`` would write beside the weights."""
    named = model_name(ckpt.path) == ckpt.path.name  # llama.cpp names the model by this folder's name
    if ckpt.raw.hf_config and ckpt.path.is_dir() and ckpt.side_folder == ckpt.path and named:
        yield ckpt.path
        return
    if ckpt.raw.hf_config and is_dir(ckpt.path):  # not on this disk, --tokenizer, a Hub snapshot: copied here
        with tempfile.TemporaryDirectory(prefix="ckptkit-gguf-") as tmp:
            folder = Path(tmp) / model_name(ckpt.path)
            folder.mkdir()
            for src in [ckpt.path / ckpt.raw.config_name, *ckpt.extra_files()]:
                copy_file(src, folder / src.name)
            try:
                yield folder
            except CkptkitError as e:  # named by the source, not this temporary folder
                raise CkptkitError(str(e).replace(str(folder), str(ckpt.path))) from None
            finally:
                ckpt.notes[:] = [n.replace(str(folder), str(ckpt.path)) for n in ckpt.notes]
        return
    hf = transformers_format()
    plan = hf.planner(hf).tokenizer(ckpt)
    with tempfile.TemporaryDirectory(prefix="ckptkit-gguf-") as tmp:
        folder = Path(tmp) / model_name(ckpt.path)
        folder.mkdir()
        for src in ckpt.extra_files():
            if src.name not in plan.skip:
                copy_file(src, folder / src.name)
        for name, data in plan.files.items():
            (folder / name).write_bytes(data)
        ids = {k: v for k, v in plan.ids.items() if hparams.get(k) is None and v is not None}
        (folder / str(hf.info.config_file)).write_text(json.dumps({**hparams, **ids}, indent=2), encoding="utf-8")
        if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            raise no_tokenizer(ckpt.path)  # named by the source, not this temporary folder
        made = str(folder / "tokenizer.json"), f"the tokenizer.json made of {ckpt.path}'s tokenizer"
        try:
            yield folder
        except CkptkitError as e:  # named by the source, not this temporary folder
            raise CkptkitError(str(e).replace(*made).replace(str(folder), str(ckpt.path))) from None
        finally:
            ckpt.notes[:] = [n.replace(*made).replace(str(folder), str(ckpt.path)) for n in ckpt.notes]


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
    """A checkpoint's name as llama.cpp's converters take it: its folder's, or its file's stem;
    for a Hub cache snapshot (``models--org--name/snapshots/COMMIT``) the repository's name."""
    if is_dir(path) and path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.rsplit("--", 1)[-1]
    return path.name if is_dir(path) else path.stem


def _not_kept(hparams: dict[str, Any], spec: Any) -> list[str]:
    """Notes on config.json fields the GGUF has no key for whose values are not the ones
    llama.cpp assumes: it will not run the source's model. (A field left empty is
    transformers' default, as one left out.)"""
    lost = [
        f"{field} {hparams[field]} (llama.cpp assumes {value})"
        for field, value in assumed_fields(spec, hparams).items()
        if hparams.get(field) not in (None, []) and hparams[field] != value
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

    doc = read_json_shared(folder / "tokenizer.json")
    n = len((doc.get("model") or {}).get("vocab") or {}) + len(doc.get("added_tokens") or [])
    rows = next((t.shape[0] for t in tensors if t.name == "token_embd.weight"), 0)
    if n < rows:
        raise CkptkitError(
            f"{folder / 'tokenizer.json'}: llama.cpp keeps only the first {n} of the {rows} embedding rows "
            "(as many as the tokenizer has tokens); ckptkit does not write a GGUF that cannot convert back whole"
        )


NARROWING = ("float16", "bfloat16")  # --dtype casts that can overflow (refused) or underflow (noted)


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _chunks(t: GGUFTensor, checked: bool, reader: SpanReader, buffers: ChunkBuffers) -> Iterable[bytes | memoryview]:
    """``t``'s GGML bytes a chunk at a time: from the source's bytes with numpy where they lie
    there as stored (:mod:`~ckptkit.formats.gguf.rows`, read by ``reader`` into ``buffers``),
    else through torch (``checked``: a narrowing cast that overflows a value is
    an error naming ``t``)."""
    import gguf

    if t.source is not None and t.weights is None:
        chunks = row_chunks(t.source, gguf.GGMLQuantizationType(t.qtype).name, t.heads, reader, buffers, t.moved)
        if chunks is not None:
            return chunks
    return quantized_chunks(t.make(), t.qtype, t.name if checked else None, t.weights)


def planned_writer(arch: str, tensors: list[GGUFTensor]) -> gguf.GGUFWriter:
    """A ``gguf.GGUFWriter`` for ``arch`` holding the tensor infos of ``tensors`` (shapes and
    types only: the bytes are written by :class:`GGUFFileWriter`)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(None, arch)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)  # shape as given
    return w


def last_keys(w: Any, ftype: Any, extra: list[tuple[str, Any]]) -> None:
    """llama-quantize's header: the 16-bit GGUF's keys, less ``general.quantization_version``
    and ``general.file_type``, which come last (set again, in that order), then ``extra``
    (its imatrix keys: strings, or integers written as uint32)."""
    import gguf

    kv = w.kv_data[0]
    for key in (gguf.Keys.General.QUANTIZATION_VERSION, gguf.Keys.General.FILE_TYPE):
        kv.pop(key, None)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(ftype))
    for key, value in extra:
        kv.pop(key, None)
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)


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


@dataclass
class GGUFPlan(Plan):
    """A GGUF's plan: its header (key/values and tensor infos, encoded by ``gguf``) and, by
    name in file order, how each tensor is made and which GGML type it is stored as."""

    header: gguf.GGUFWriter | None = None
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)
    checked: bool = False  # a narrowing cast that overflows a value is an error (underflows are noted)

    def nbytes(self, key: str) -> int:
        return self.tensors[key].nbytes

    def writer(self, path: Path, file: FilePlan, direct: bool) -> GGUFFileWriter:
        return GGUFFileWriter(path, self, direct)

    def approximates(self, name: str, kind: str, rounded_to: str) -> bool:
        """The read-back tensor ``name`` differs from the source as its stored type says:
        widened (same values), rounded to its F16/BF16, or quantized."""
        import gguf

        t = self.tensors.get(name)
        if t is None:
            return False
        stored = gguf.GGMLQuantizationType(t.qtype).name
        if kind == "cast":
            return True
        if kind == "rounded":
            return PLAIN.get(stored) == rounded_to
        return kind in ("values", "ggml") and stored not in PLAIN  # "ggml": verify saw the GGML type


def gguf_plan(fmt: str, w: gguf.GGUFWriter, tensors: list[GGUFTensor], file_name: str, checked: bool) -> GGUFPlan:
    """The plan of one GGUF file (format ``fmt``): header ``w`` and ``tensors`` in file order."""
    from ckptkit.tensors.lazy import Lazy

    targets = {
        t.name: Lazy(t.shape, t.source.dtype if t.source is not None else "float32", t.make, pieces=streamed(t))
        for t in tensors
    }
    files = [FilePlan(file_name, list(targets))]
    return GGUFPlan(fmt, targets, files, header=w, tensors={t.name: t for t in tensors}, checked=checked)


class GGUFFileWriter(FileWriter):
    """One GGUF file: header, key/values and tensor infos written when it is made, then each
    tensor's bytes at its aligned offset, made a chunk at a time (:meth:`chunks`)."""

    def __init__(self, path: Path, plan: GGUFPlan, direct: bool = False) -> None:
        w = plan.header
        assert w is not None
        w.write_header_to_file(path=path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        try:
            start = _aligned(fout.tell(), w.data_alignment)
        finally:
            fout.close()
            w.fout = None
        self._places: dict[str, tuple[int, int]] = {}
        for t in plan.tensors.values():  # in file order (see docs/formats.md)
            self._places[t.name] = (start, t.nbytes)
            start = _aligned(start + t.nbytes, w.data_alignment)
        os.truncate(path, start)  # the padding: zeros
        super().__init__(path, direct)
        self._tensors = plan.tensors
        self._checked = plan.checked
        self._pending = set(self._places)
        self._reader = SpanReader()  # one for the file: source CRC-32s fed as read, every record checked at the end
        # each chunk is written on a worker thread while the next is made: as many chunks
        # in flight as the engine queues, plus the one being made, each in its own buffers
        self._buffers = HeldBuffers(DEPTH + 1)

    def _place(self, name: str) -> tuple[int, int]:
        return self._places[name]

    def _done(self, name: str, crc: int | None) -> None:
        self._pending.discard(name)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` converted to the tensor's GGML type (a narrowing cast checked if asked)."""
        offset, _ = self._places[name]
        t = self._tensors[name]
        for chunk in quantized_chunks(tensor, t.qtype, name if self._checked else None, t.weights):
            self._out.write(chunk, offset)
            offset += memoryview(chunk).nbytes
        self._done(name, None)

    def chunks(self, name: str, lazy: Lazy) -> Iterator[tuple[Job, int]]:
        return self._chunk_jobs(name, lazy)

    def _chunk_jobs(self, name: str, lazy: Lazy) -> Iterator[tuple[Job, int]]:
        t = self._tensors[name]
        offset, nbytes = self._places[name]
        if lazy.pieces is not None:  # the plan's streamed(t)
            yield from piece_jobs(self._out, t, lazy.pieces, offset, nbytes, self._buffers)
            self._done(name, None)
            return
        written = 0
        self._buffers.lead = offset % ALIGN  # each chunk made where its pages can go direct
        made = self._buffers.made
        for chunk in _chunks(t, self._checked, self._reader, self._buffers):
            n = memoryview(chunk).nbytes
            turn = self._buffers.turn if self._buffers.made != made else -1  # -1: not made in a set
            made = self._buffers.made
            then = functools.partial(self._buffers.release, turn) if turn >= 0 else nothing  # -1: no set
            yield functools.partial(write_then, self._out, chunk, offset + written, then), n
            written += n
            self._buffers.lead = (offset + written) % ALIGN
        if written != nbytes:
            raise RuntimeError(f"{name}: wrote {written} bytes, planned {nbytes}")
        self._done(name, None)

    def _finish(self) -> None:
        self._reader.close()  # every source record read is checked before the file is published
        if self._pending:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")

    def discard(self) -> None:
        self._reader.close(check=False)
        super().discard()


def recorded_pre(ckpt: OpenedCheckpoint) -> str | None:
    """The ``tokenizer.ggml.pre`` of a GGUF source whose own byte-level BPE tokenizer is written
    (not one ``--tokenizer`` gives), if llama.cpp knows the name."""
    from ckptkit.formats.gguf.reader import meta_str

    header = getattr(ckpt.raw, "header", None)  # a GGUFCheckpoint's
    if header is None or ckpt.side_folder != ckpt.raw.files_folder():
        return None
    pre = meta_str(header, "tokenizer.ggml.pre") if meta_str(header, "tokenizer.ggml.model") == "gpt2" else None
    return pre if pre in PRE_NAMES else None


def plan_model(fmt: str, ckpt: OpenedCheckpoint, opts: Options) -> GGUFPlan:
    """``ckpt`` as llama.cpp's converter would write it: header, metadata and tensor infos
    from shapes and types, and how each tensor's bytes are made."""
    import gguf

    # a GGUF's tensors written back (merge, training; :func:`ckptkit.save_checkpoint_like`): its own types
    same = (ckpt.recorded_origin or {}).get("gguf") if opts.dtype is None else None
    dtype = opts.dtype if same is None else kept_dtype(same["file_type"])
    spec = spec_of(ckpt.family, ckpt.path)
    hparams = hf_hparams(ckpt)
    if spec.linear_attention:
        hparams = hybrid_hparams(hparams, ckpt.tensors)
    elif spec.skipped:  # a multimodal release: llama.cpp reads its text_config at the top
        hparams = {**hparams, **hparams.get("text_config", {})}
    imatrix = None
    if opts.quant.imatrix is not None and quantize_type(dtype) is not None:
        imatrix = load_imatrix(opts.quant.imatrix)
    tensors, ftype = model_tensors(ckpt, hparams, dtype, opts.quant, imatrix)
    if same is not None:
        ckpt.notes.extend(keep_types(tensors, same["types"], ckpt.path))
    ckpt.notes.extend(_not_kept(hparams, spec))
    w = planned_writer(spec.arch, tensors)
    with hf_folder(ckpt, hparams) as folder, quiet_gguf():
        w.add_type(gguf.GGUFType.MODEL)
        if spec.embeddings_to_vocab:
            _check_vocab_rows(folder, tensors)
        add_model_card(w, folder, model_name(ckpt.path))
        add_parameters(w, spec.parameters, hparams, ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        pre, by = (opts.gguf_pre, ASKED) if opts.gguf_pre is not None else (recorded_pre(ckpt), RECORDED)
        ckpt.notes.extend(add_vocab(w, spec.vocab, folder, hparams, pre, by))
    if quantize_type(dtype) is not None:
        last_keys(w, ftype, imatrix.metadata() if imatrix is not None else [])
    checked = dtype in NARROWING and not opts.allow_lossy_cast
    plan = gguf_plan(fmt, w, tensors, model_name(ckpt.path) + ".gguf", checked)
    plan.left_out = _left_out(ckpt, spec, hparams)
    return plan


def _left_out(ckpt: OpenedCheckpoint, spec: GGUFSpec, hparams: dict[str, Any]) -> frozenset[str]:
    """The canonical names of the source's tensors llama.cpp does not write (MTP layers,
    a multimodal release's towers: noted when written, ignored by verify)."""
    hf = transformers_format()
    canonical = {native: c[0] for native, c, _ in hf.planner(hf).rules(ckpt) if len(c) == 1}
    mtp, towers = left_out(spec, hparams, list(hf_targets(ckpt)))
    return frozenset(canonical.get(n, n) for n in mtp + towers)
