"""The vocabulary formats share: a checkpoint's raw layout on read, a plan of files on write."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckptkit.errors import CkptkitError
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import Span, open_source, read_at, read_spans, take
from ckptkit.models.fields import check_config_fields
from ckptkit.tensors.transforms import RANKS
from ckptkit.tokenization import TokenizerPlan
from ckptkit.untrusted import loads_json

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.writers import TensorWriter
    from ckptkit.models import Family, ModelConfig
    from ckptkit.quant import Quantization
    from ckptkit.tensors.lazy import Lazy

REPLICA_CHUNK = 16 << 20
MAX_JSON_BYTES = 256 << 20  # config, index and sidecar files are far smaller
ORIGIN_FILE = "ckptkit-origin.json"  # sidecar beside converted weights: the source's layout
INTERNAL_FILE = "ckptkit.json"  # the internal format's own description


class TensorReader(Protocol):
    infos: dict[str, TensorInfo]

    def read(self, name: str) -> torch.Tensor: ...

    def sample(self, name: str, nbytes: int) -> bytes: ...

    def span(self, name: str) -> Span | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class QuantOptions:
    """llama-quantize's options for a ``--dtype Q4_K_M``-style GGUF: ``--imatrix FILE``,
    ``--output-tensor-type``, ``--token-embedding-type`` (GGML type names), ``--pure``,
    ``--leave-output-tensor``."""

    imatrix: str | Path | None = None
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    pure: bool = False
    leave_output_tensor: bool = False

    def given(self) -> list[str]:
        """The flags set, as the CLI spells them."""
        flags = {
            "--imatrix": self.imatrix is not None,
            "--output-tensor-type": self.output_tensor_type is not None,
            "--token-embedding-type": self.token_embedding_type is not None,
            "--pure": self.pure,
            "--leave-output-tensor": self.leave_output_tensor,
        }
        return [flag for flag, on in flags.items() if on]


@dataclass
class Options:
    """What the user asked of a conversion."""

    to: str
    dtype: str | None = None
    shards: int | None = None
    max_shard_size: str | None = None
    allow_lossy_cast: bool = False  # let --dtype overflow values to inf
    experts: str | None = None  # MoE experts on disk: "per-expert" or "stacked" (None: as the source)
    gguf_pre: str | None = None  # GGUF's tokenizer.ggml.pre for a BPE tokenizer llama.cpp does not recognise
    quant: QuantOptions = field(default_factory=QuantOptions)  # llama-quantize's options (GGUF)


@dataclass
class FilePlan:
    """One output weight file: its tensors in stored order and, for Meta ranks, the split."""

    name: str
    keys: list[str]
    metadata: dict[str, str] | None = None
    rank: int = 0
    ranks: int = 1
    aliases: dict[str, str] = field(default_factory=dict)  # key stored as another key's storage -> that key
    archive: dict[str, str] | None = None  # a restored torch pickle's zip folder name and serialization id


class WriterFactory(Protocol):
    """Makes the writer of one output weight file of a plan (see :meth:`Plan.writer`)."""

    def __call__(self, path: Path, plan: Plan, file: FilePlan, direct: bool) -> TensorWriter: ...


@dataclass
class Plan:
    """Everything a conversion will write, decided before any tensor is read."""

    format: str
    targets: dict[str, Lazy]  # native name -> full tensor to write
    files: list[FilePlan]
    split_dims: dict[str, int | None] = field(default_factory=dict)
    metadata_files: dict[str, str] = field(default_factory=dict)  # name -> text
    restored: bool = False
    notes: list[str] = field(default_factory=list)
    tokenizer: TokenizerPlan = field(default_factory=TokenizerPlan)
    verify_cast: str | None = None  # --verify compares the output with the source cast to this dtype
    writes: WriterFactory | None = None  # the writer of each weight file, as the format planned it
    quant_config: dict[str, Any] | None = None  # the quantization_config of the quantized weights written
    left_out: frozenset[str] = frozenset()  # canonical names the format does not hold (noted); verify ignores them

    def writer(self, path: Path, file: FilePlan, direct: bool) -> TensorWriter:
        """The writer of weight file ``file`` at ``path`` (``direct``: whole pages past the
        page cache), as the format that planned it chose."""
        if self.writes is None:  # pragma: no cover - every planner says
            raise TypeError(f"{file.name}: planned with no writer")
        return self.writes(path, self, file, direct)

    def entries(self, file: FilePlan) -> list[tuple[str, str, tuple[int, ...]]]:
        """``file``'s tensors as (name, dtype, shape stored in this file), in stored order."""
        shape = RANKS.shard_shape
        return [(k, t.dtype, tuple(shape(t.shape, file.ranks, self.split_dims.get(k)))) for k, t in self._of(file)]

    def _of(self, file: FilePlan) -> list[tuple[str, Lazy]]:
        return [(k, self.targets[k]) for k in file.keys]

    def nbytes(self, key: str) -> int:
        """The bytes tensor ``key`` takes in the output (all its ranks together)."""
        return self.targets[key].nbytes

    def approximates(self, name: str, kind: str, rounded_to: str) -> bool:
        """Whether the output's tensor ``name`` read back may differ from the source by
        ``kind`` (:mod:`ckptkit.verify`'s kinds; ``rounded_to``: for "rounded", the dtype):
        never, unless the format stores tensors approximately (GGUF's types)."""
        return False


@dataclass
class RawCheckpoint:
    """Native tensor names, their files and metadata, with lazy tensor access.

    Attributes:
        format: the format name (``meta``, ``hf``, ``hf-bin``, ``internal``).
        root: the checkpoint directory.
        files: weight files in order, each with its tensor names in stored order.
        infos: every native tensor (Meta ranks merged) in stored order.
        config_name / config_text / config: the metadata file (config.json, params.json).
        hf_config: ``config`` is a Hugging Face ``config.json``, as transformers reads it
            (an HF folder's, or the one a DCP folder holds).
        index: ``{"name", "text"}`` of an HF index file, or None.
        file_metadata: safetensors ``__metadata__`` per file (None for pickles).
        split_dims: Meta rank-split dim per tensor (None: replicated); empty otherwise.
        file_aliases: per pickle file, tensors stored as another tensor of it -> that tensor.
        ignored: entries the files hold besides the model (a DCP folder's optimizer and
            train state), listed by ``inspect``, never converted.
        lossy: tensors read only approximately (native name -> stored type): quantized
            tensors, dequantized to float32 on read; a conversion needs an explicit --dtype.
        notes: what the format says about the conversion (a tokenizer it could not rebuild).
    """

    format: str
    root: Path
    files: dict[str, list[str]]
    infos: dict[str, TensorInfo]
    readers: dict[str, TensorReader]
    config_name: str
    config_text: str
    config: dict[str, Any]
    index: dict[str, str] | None = None
    file_metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)
    split_dims: dict[str, int | None] = field(default_factory=dict)
    file_aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    lossy: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # entries besides the model (optimizer state)
    hf_config: bool = False
    stored_names: dict[str, str] = field(default_factory=dict)  # a name read -> the tensor stored (X.weight_packed)

    def files_folder(self) -> Path | None:
        """A folder the format made with the checkpoint's non-weight files (tokenizer,
        generation config), or None: they lie beside the weights."""
        return None

    def info(self, name: str) -> TensorInfo:
        """The stored metadata of native tensor ``name`` (under its stored name)."""
        return self.infos[self.stored_names.get(name, name)]

    def read(self, name: str) -> torch.Tensor:
        """One native tensor, materialised (Meta ranks concatenated)."""
        # Meta ranks each hold every tensor (checked when opened); other formats one file per tensor.
        name = self.stored_names.get(name, name)
        files = list(self.files) if self.split_dims else [self.infos[name].file]
        if len(files) > 1 and self.split_dims.get(name) is None:
            return self._replicated(name, files)
        parts = [self.readers[f].read(name) for f in files]
        if len(parts) == 1:
            return parts[0]
        return RANKS.forward(parts, self.split_dims.get(name))

    def spans(self, name: str) -> list[Span] | None:
        """Where one native tensor's bytes lie as stored (Meta ranks: the merge's byte
        ranges), or None when some part is not one stored range."""
        name = self.stored_names.get(name, name)
        if not self.split_dims:
            span = self.readers[self.infos[name].file].span(name)
            return None if span is None else [span]
        parts = [self.readers[f].span(name) for f in self.files]
        if any(p is None for p in parts):
            return None
        if self.split_dims.get(name) is None:
            self._replicated_spans(name, parts)  # type: ignore[arg-type]
        shard = self.readers[next(iter(self.files))].infos[name].shape
        return RANKS.forward_spans([[p] for p in parts if p is not None], shard, self.split_dims.get(name))

    def _replicated_spans(self, name: str, parts: list[Span]) -> None:
        """:meth:`_replicated` on the stored bytes (no torch), 16 MiB at a time."""
        files = list(self.files)
        for start in range(0, parts[0].nbytes, REPLICA_CHUNK):
            n = min(REPLICA_CHUNK, parts[0].nbytes - start)
            first = read_spans(take([parts[0]], start, n))
            for f, part in zip(files[1:], parts[1:], strict=True):
                if read_spans(take([part], start, n)) != first:
                    raise self._disagree(name, files[0], f)

    def _disagree(self, name: str, a: str, b: str) -> CkptkitError:
        return CkptkitError(
            f"{self.root / a} and {self.root / b}: replicated tensor {name!r} differs between the ranks; "
            "the checkpoint is inconsistent"
        )

    def _replicated(self, name: str, files: list[str]) -> torch.Tensor:
        """A tensor every rank holds whole: rank 0's copy, after checking that each other
        rank's is bitwise the same (one other copy in memory at a time)."""
        import torch

        first = self.readers[files[0]].read(name)
        for f in files[1:]:
            other = self.readers[f].read(name)
            if not torch.equal(first.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)):
                raise self._disagree(name, files[0], f)
            del other
        return first

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


class OpenedCheckpoint(Protocol):
    """What a format needs of an opened checkpoint (:class:`ckptkit.checkpoint.Checkpoint`)
    to write it: declared here so that no format module imports the reader."""

    path: Path
    family: Family
    config: ModelConfig
    raw: RawCheckpoint
    tensors: dict[str, Lazy]
    unused: dict[str, Lazy]
    recorded_origin: dict[str, Any] | None
    notes: list[str]
    quant: Quantization | None

    @property
    def origin(self) -> dict[str, Any]: ...

    @property
    def side_folder(self) -> Path: ...

    def extra_files(self) -> list[Path]: ...


def _json_text(path: Path) -> str:
    """The text of a JSON file, at most MAX_JSON_BYTES; one-line errors when it is unreadable."""
    try:
        src = open_source(path)
        try:
            text = read_at(src, 0, min(src.size(), MAX_JSON_BYTES + 1)).decode("utf-8")
        finally:
            src.close()
    except EOFError:
        raise CkptkitError(f"{path}: changed while it was read (shorter than its size)") from None
    except OSError as e:
        raise CkptkitError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise CkptkitError(f"{path}: not valid UTF-8 JSON") from None
    if len(text) > MAX_JSON_BYTES:
        raise CkptkitError(f"{path}: larger than {MAX_JSON_BYTES >> 20} MiB; not a checkpoint's JSON file")
    return text


def _json_object(text: str, path: Path) -> dict[str, Any]:
    data = loads_json(text, path)
    if not isinstance(data, dict):
        raise CkptkitError(f"{path}: expected a JSON object")
    return data


def read_json(path: Path) -> tuple[str, dict[str, Any]]:
    """A JSON object file as (text, parsed); one-line errors for unreadable or invalid ones."""
    text = _json_text(path)
    return text, _json_object(text, path)


# path -> (text, parsed) while a shared_json() scope is open (a parsed Llama 3 tokenizer.json: ~70 MiB)
_SHARED: ContextVar[dict[str, tuple[str, dict[str, Any]]] | None] = ContextVar("ckptkit_shared_json", default=None)


@contextmanager
def shared_json() -> Iterator[None]:
    """A scope (one conversion's) in which :func:`read_json_shared` keeps what it parses; all of
    it is dropped when the outermost scope ends, so nothing stays between conversions."""
    if _SHARED.get() is not None:  # nested: the outer scope keeps and drops
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def read_json_shared(path: Path) -> dict[str, Any]:
    """:func:`read_json`'s parsed object, parsed and checked once per :func:`shared_json` scope
    while the file's text stays the same (one conversion reads a tokenizer.json several times):
    read again each call, parsed only when its text differs from the last parse of ``path`` in
    the scope; outside a scope, parsed each call. Callers must not change it."""
    text, key, kept = _json_text(path), str(path), _SHARED.get()
    cached = kept.get(key) if kept is not None else None
    if cached is not None and cached[0] == text:
        return cached[1]
    data = _json_object(text, path)
    if kept is not None:
        kept[key] = text, data
    return data


def read_config(path: Path) -> tuple[str, dict[str, Any]]:
    """A config.json / params.json as (text, parsed), its known fields type- and range-checked."""
    text, data = read_json(path)
    check_config_fields(path.name, data, path)
    return text, data


def natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
