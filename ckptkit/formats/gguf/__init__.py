"""GGUF, llama.cpp's one-file format: written as its ``convert_hf_to_gguf.py`` writes it, read back.

Modules: ``reader`` (the header, as untrusted input), ``params`` (the ``<arch>.*`` keys both
ways), ``vocab`` (the ``tokenizer.ggml.*`` keys written), ``tokenizer`` (tokenizer files
rebuilt from them), ``tensors`` (names, order, types and transforms written), ``model``
(family, config and layout read back), ``widened`` (F32 tensors read back in the model's
dtype), ``adapter`` (LoRA adapters written), ``quants`` (Q8_0 written; Q8_0 and k-quants
dequantized), ``writer`` (the streaming write). Which families llama.cpp converts, and how,
is family data (:mod:`ckptkit.models.gguf_spec`).
"""

from __future__ import annotations

import functools
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, UnknownModel, note
from ckptkit.formats.base import OpenedCheckpoint, Options, Plan, RawCheckpoint
from ckptkit.formats.format import CheckpointFormat, FormatInfo, Support
from ckptkit.formats.gguf import model, mxfp4_read, nvfp4
from ckptkit.formats.gguf.mix import CONVERTER_NAMES, FILE_TYPES, quantize_type
from ckptkit.formats.gguf.reader import PLAIN, GGUFHeader, meta_int, meta_str, read_header, summary
from ckptkit.formats.gguf.tensors import GGUF_DTYPES
from ckptkit.formats.gguf.widened import file_dtype, narrowed, widened
from ckptkit.formats.records import LayoutRecord
from ckptkit.formats.registry import register
from ckptkit.formats.tensor_info import TensorInfo
from ckptkit.io import Span, is_file, open_source, read_at

if TYPE_CHECKING:
    import torch

    from ckptkit.models import Family, ModelConfig
    from ckptkit.models.spec import Layout
    from ckptkit.tensors.lazy import Lazy


class GGUFTensors:
    """Lazy reads of one GGUF's tensors: F32/F16/BF16 as stored (and as byte spans), but the
    F32 tensors llama.cpp widened from a bf16 or f16 model in that dtype where exact
    (:meth:`restore_dtypes`); Q8_0 and k-quants dequantized to float32 a chunk of blocks at a time."""

    def __init__(self, header: GGUFHeader) -> None:
        self.header = header
        self.path = header.path
        self.stored = {t.name: t for t in header.tensors}
        self.scales, self.input_scales = nvfp4.read_companions(header)  # NVFP4 weights' scales: not model tensors
        hidden = {*self.scales.values(), *self.input_scales}
        self.infos = {
            t.name: TensorInfo(t.name, t.shape, PLAIN.get(t.kind, "float32"), header.path.name)
            for t in header.tensors
            if t.name not in hidden
        }
        self.narrow: dict[str, str] = {}  # F32 tensors read back as this dtype (:mod:`.widened`)
        self._kept: dict[str, torch.Tensor] = {}  # 1-D tensors as read() gives them, from that decision's read
        self._file: Any = None

    def restore_dtypes(self) -> None:
        """Read each F32 tensor llama.cpp widened from the file type (bf16, f16) back in that
        dtype when all its values are exact there (:mod:`.widened`); the 1-D ones (small) are
        kept from this read."""
        dtype = file_dtype(self.header)
        for t in widened(self.header):
            assert dtype is not None
            stored = self._as_stored(t.name)
            narrow = narrowed(stored, dtype)
            if narrow is not None:
                self.narrow[t.name] = dtype
                self.infos[t.name] = TensorInfo(t.name, t.shape, dtype, self.path.name)
            if len(t.shape) <= 1:
                self._kept[t.name] = stored if narrow is None else narrow

    def _pread(self, offset: int, n: int) -> bytearray:
        if self._file is None:
            self._file = open_source(self.path)
        try:
            return read_at(self._file, offset, n)
        except EOFError:
            raise CkptkitError(f"{self.path}: unexpected end of file (truncated while reading)") from None

    def _as_stored(self, name: str) -> torch.Tensor:
        import torch

        from ckptkit.tensors.dtypes import to_torch

        t = self.stored[name]
        data = self._pread(t.offset, t.nbytes)
        return torch.frombuffer(data, dtype=torch.uint8).view(to_torch(PLAIN[t.kind])).reshape(t.shape)

    def stored_bytes(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s bytes as stored, uint8 [..., rows, bytes of a row] (its type's blocks)."""
        import torch

        t = self.stored[name]
        rows = t.shape[:-1]
        data = torch.frombuffer(self._pread(t.offset, t.nbytes), dtype=torch.uint8)
        return data.reshape(*rows, -1) if t.nbytes else data.reshape(*rows, 0)

    def read(self, name: str) -> torch.Tensor:
        import torch

        from ckptkit.formats.gguf.quants import dequantize_into, dequantizer

        t, info = self.stored[name], self.infos[name]
        if name in self._kept:
            return self._kept[name].clone()
        if name in self.narrow:
            narrow = narrowed(self._as_stored(name), self.narrow[name])
            if narrow is None:
                raise CkptkitError(f"{self.path}: tensor {name!r} changed while it was read")
            return narrow
        if t.kind in PLAIN:
            return self._as_stored(name)
        if dequantizer(t.kind) is None:
            raise CkptkitError(
                f"{self.path}: tensor {name!r} is {t.kind}, a type neither ckptkit nor the gguf package "
                "dequantizes (they read F32, F16, BF16 and the quantized types llama.cpp's gguf-py implements)"
            )
        out = torch.empty(info.shape, dtype=torch.float32)
        scale = self.scales.get(name)
        if scale is None:
            return dequantize_into(out, t.kind, lambda start, n: self._pread(t.offset + start, n))
        factors = nvfp4.factors(self._as_stored(scale), name, self.path)
        part = t.nbytes // len(factors)  # an expert's bytes, of a merged weight
        for e, factor in enumerate(factors):  # modelopt's dequantization, one expert at a time
            decode = functools.partial(nvfp4.ggml_values, factor=factor)
            dequantize_into(
                out[e] if len(factors) > 1 else out, t.kind, functools.partial(self._at, t.offset + e * part), decode
            )
        return out

    def _at(self, base: int, start: int, n: int) -> bytearray:
        return self._pread(base + start, n)

    def span(self, name: str) -> Span | None:
        t = self.stored[name]
        return Span(self.path, t.offset, t.nbytes) if t.kind in PLAIN and name not in self.narrow else None

    def sample(self, name: str, nbytes: int) -> bytes:
        t = self.stored[name]
        return bytes(self._pread(t.offset, min(nbytes, t.nbytes)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class GGUFCheckpoint(RawCheckpoint):
    """A GGUF opened for reading: the file's tensors by GGUF name, config.json fields from its
    metadata, and its tokenizer files rebuilt (on first use) into a temporary folder."""

    header: GGUFHeader
    unsure: str | None = None  # why the metadata gives no config.json
    release: bool = False  # shown as the MXFP4 release llama.cpp converted (:mod:`.mxfp4_read`)
    _side: Path | None = None

    def files_folder(self) -> Path | None:
        if self._side is None:
            from ckptkit.formats.gguf.tokenizer import tokenizer_files

            files, notes = tokenizer_files(self.header, self.config.get("max_position_embeddings"))
            self.notes.extend(notes)
            tmp = Path(tempfile.mkdtemp(prefix="ckptkit-gguf-"))
            folder = tmp / "tokenizer"
            folder.mkdir()
            for name, data in files.items():
                (folder / name).write_bytes(data)
            self._side = folder
        return self._side

    def close(self) -> None:
        super().close()
        if self._side is not None:
            shutil.rmtree(self._side.parent, ignore_errors=True)
            self._side = None


class GGUFRecord(LayoutRecord):
    """No sidecar and never restored by a conversion (written afresh, as llama.cpp writes it);
    its own layout is the file type and each tensor's GGML type, which a GGUF written back
    from this one's tensors keeps (merge, training)."""

    def __init__(self) -> None:
        super().__init__(sidecar=False, restores=False)

    def own(self, ckpt: OpenedCheckpoint) -> dict[str, Any]:
        header = _header(ckpt.raw)
        types = {t.name: t.kind for t in header.tensors}
        return {"gguf": {"file_type": meta_int(header, "general.file_type"), "types": types}}


class GGUFFormat(CheckpointFormat):
    """One ``.gguf`` file as llama.cpp writes it; as SRC or DST, a file path ending in ``.gguf``."""

    name = "gguf"
    info = FormatInfo(
        expects="a .gguf file",
        weight_file=re.compile(r"[^/]+\.gguf"),
        detect_order=5,
        layer_field="block_count",
        reads_file=True,  # SRC is one file
        file_suffix=".gguf",  # DST is one file, not a folder
        extra_dtypes=("q8_0", *(n for n in FILE_TYPES if n not in CONVERTER_NAMES)),
        takes_pre_tokenizer=True,
        lone_file=re.compile(r"(?s:.*)\.gguf"),
        writes_adapters=True,  # SRC may be a LoRA adapter: llama.cpp's LoRA GGUF (``plan_adapter``)
    )

    records = GGUFRecord()

    # --- reading ------------------------------------------------------------------------
    def detect(self, root: Path) -> bool:
        return is_file(root) and root.suffix == ".gguf"

    def open(self, root: Path, config: Path | None = None) -> RawCheckpoint:
        if not is_file(root):  # asked by name (--from gguf, a written GGUF verified): any file name
            raise CkptkitError(f"{root}: not a GGUF checkpoint (expected a file ending in .gguf)")
        header = read_header(root)
        tensors = GGUFTensors(header)
        unsure = None
        try:
            tensors.restore_dtypes()
            try:
                if meta_str(header, "general.type") == "adapter":  # what --to gguf writes for a LoRA adapter
                    raise CkptkitError("it is a LoRA adapter GGUF (general.type adapter), not a model")
                hf_config = model.hf_config(header, lambda: tensors.read(model.ROPE_FREQS).reshape(-1))
            except CkptkitError as e:  # inspect still lists the tensors; model() says why
                hf_config, unsure = {}, str(e)
        except BaseException:
            tensors.close()
            raise
        kept = [t for t in header.tensors if t.name in tensors.infos]
        raw = GGUFCheckpoint(
            format=self.name,
            root=root.parent,
            files={root.name: [t.name for t in kept]},
            infos=dict(tensors.infos),
            readers={root.name: tensors},
            config_name=root.name,
            config_text="",
            config=hf_config,
            lossy={t.name: t.kind for t in kept if t.kind not in PLAIN},
        )
        if tensors.input_scales:
            fact = f"{len(tensors.input_scales)} NVFP4 input_scale tensor(s) not read: they scale activations"
            raw.notes.append(note(fact))
        raw.header, raw.unsure = header, unsure
        if hf_config and mxfp4_read.holds_release(header):
            from ckptkit.formats.gguf.hf_view import as_release

            try:
                raw.release = as_release(raw, header)
            except BaseException:
                raw.close()
                raise
        return raw

    def model(self, raw: RawCheckpoint, family: Family | None = None) -> tuple[Family, ModelConfig]:
        if family is None:
            unsure = _opened(raw).unsure
            if unsure is not None:
                raise UnknownModel(f"cannot tell the model type: {unsure}")
            family = model.family_of(_header(raw), raw.config)
        if not raw.config:
            raise UnknownModel(f"{raw.root / raw.config_name}: no model type ckptkit knows; see inspect")
        try:
            return family, family.config_from_hf(raw.config)
        except (KeyError, TypeError, ValueError) as e:
            raise CkptkitError(f"{raw.root / raw.config_name}: metadata lacks or misstates {e}") from None

    def layout(self, family: Family, cfg: ModelConfig) -> Layout:
        """The GGUF names of the family's HF tensors; the release's own names where the GGUF
        is read as an MXFP4 release (:mod:`.mxfp4_read`: ``cfg`` holds its blocks)."""
        from ckptkit.formats.gguf.hf_view import hf_layout

        spec = model.spec_for(family, family.name)
        release = hf_layout(family, cfg, spec)
        if any(r.native.endswith(mxfp4_read.BLOCKS) for r in release.layer):
            return release
        return model.layout(family, cfg)

    def canonical_view(
        self, raw: RawCheckpoint, family: Family, cfg: ModelConfig
    ) -> tuple[dict[str, Lazy], dict[str, Lazy]]:
        """The HF layout's canonical tensors; Gemma's ``1 + w`` norms undone exactly (or refused
        when read), in the file type's dtype where ``w`` is exact there (as other widened
        tensors, :mod:`.widened`); ``rope_freqs.weight`` is the config's rope scaling, not carried."""
        from ckptkit.formats.canonical import canonical_view
        from ckptkit.formats.gguf.hf_view import hf_layout, hf_view, needs_view
        from ckptkit.tensors.lazy import Lazy

        spec = model.spec_for(family, family.name)
        if _opened(raw).release:  # already the release's tensors
            return canonical_view(raw, hf_layout(family, cfg, spec), cfg)
        if needs_view(spec):  # llama.cpp's splits, merges and arithmetic undone (hf_view)
            return canonical_view(hf_view(raw, family, cfg, spec), hf_layout(family, cfg, spec), cfg)
        tensors, unused = super().canonical_view(raw, family, cfg)
        unused.pop(model.ROPE_FREQS, None)
        where = raw.root / raw.config_name
        dtype = file_dtype(_header(raw))
        for name in model.plus_one_norms(family, cfg) & set(tensors):
            lazy = tensors[name]
            restored = None
            if dtype is not None:
                try:  # a norm is 1-D: the tensors keep it from their own decision's read
                    restored = dtype if narrowed(_minus_one(lazy, name, where), dtype) is not None else None
                except CkptkitError:  # refused when read, as for any other file type
                    pass
            get = functools.partial(_minus_one, lazy, name, where, restored)
            tensors[name] = Lazy(lazy.shape, restored or "float32", get, lazy.file)
        return tensors, unused

    def support(self, family: Family) -> Support:
        """Read and written for the model types llama.cpp's converter takes."""
        spec = family.gguf_spec()
        if spec is None:
            return Support(False, False, "-")
        from ckptkit.formats.gguf.experts import EXPERTS_EVERYWHERE, takes_dense_layers
        from ckptkit.formats.gguf.vocab import VOCAB_NEEDS, VOCAB_ROWS

        needs = {"tokenizer": f"{VOCAB_NEEDS[spec.vocab]} (the source's, or --tokenizer PATH)"}
        if spec.embeddings_to_vocab:
            needs["vocab"] = VOCAB_ROWS
        if (spec.experts is not None or spec.linear_attention) and not takes_dense_layers(spec):
            needs["experts"] = EXPERTS_EVERYWHERE.format(arch=spec.arch)
        tokenizer = "tokenizer.ggml.* (from the source's tokenizer; rebuilt as tokenizer files when read)"
        if not spec.reads_back:
            tokenizer = "tokenizer.ggml.* (from the source's tokenizer)"
        return Support(spec.reads_back, True, tokenizer, needs)

    def describe(self, raw: RawCheckpoint, info: dict[str, Any]) -> dict[str, Any]:
        """``inspect``: stored GGML types and bytes, the GGUF version and its key/values."""
        header = _header(raw)
        tensors = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": PLAIN.get(t.kind, t.kind.lower()),
                "file": raw.config_name,
            }
            for t in header.tensors
        ]
        return info | {
            "total_bytes": sum(t.nbytes for t in header.tensors),
            "tensors": tensors,
            "gguf_version": header.version,
            "metadata": summary(header),
        }

    # --- writing ------------------------------------------------------------------------
    def plan(self, ckpt: OpenedCheckpoint, opts: Options) -> Plan:
        """One file, laid out as llama.cpp's converter lays it out."""
        from ckptkit.formats.gguf.writer import plan_model

        _check_dtype(opts.dtype)
        return plan_model(self.name, ckpt, opts)

    def plan_adapter(self, adapter: Path, base: OpenedCheckpoint, opts: Options) -> Plan:
        from ckptkit.formats.gguf.adapter import plan_adapter

        _check_dtype(opts.dtype)
        return plan_adapter(self.name, adapter, base, opts)

    def finish(self, ckpt: OpenedCheckpoint, plan: Plan, out_dir: Path) -> None:
        return None  # everything is in the one file


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and quantize_type(dtype) is None and dtype not in GGUF_DTYPES:
        raise CkptkitError(f"--dtype for --to gguf must be one of {', '.join(GGUF_DTYPES)}, not {dtype!r}")


def _opened(raw: RawCheckpoint) -> GGUFCheckpoint:
    if not isinstance(raw, GGUFCheckpoint):  # pragma: no cover - the format opens its own
        raise TypeError(f"{raw.root}: not opened by the gguf format")
    return raw


def _header(raw: RawCheckpoint) -> GGUFHeader:
    return _opened(raw).header


def _minus_one(lazy: Lazy, name: str, where: Path, dtype: str | None = None) -> torch.Tensor:
    """``w`` of the stored ``1 + w``: float32, or ``dtype`` (where it was found exact)."""
    w = model.minus_one(lazy.get(), name, where)
    if dtype is None:
        return w
    narrow = narrowed(w, dtype)
    if narrow is None:
        raise CkptkitError(f"{where}: tensor {name!r} changed while it was read")
    return narrow


register(GGUFFormat())
