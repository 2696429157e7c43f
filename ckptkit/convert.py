"""The streaming converter: source checkpoint -> target format, one tensor at a time.

For each target tensor it fetches the canonical tensors it needs from the source,
applies the target format's transform, casts if asked, and writes it into every file
that holds it (one file for HF shards, every rank for Meta). Output goes to a temporary
directory beside the destination, put in place at the end by :func:`ckptkit.io.publishing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec

from ckptkit.checkpoint import Checkpoint, open_checkpoint, tokenizer_from
from ckptkit.errors import CkptkitError, FlagError, note
from ckptkit.formats import REGISTRY, CheckpointFormat
from ckptkit.formats.base import QuantOptions
from ckptkit.formats.gguf.mix import CONVERTER_NAMES, FILE_TYPES, ggml_type, quantize_type
from ckptkit.formats.peft_adapter import ADAPTER_CONFIG, adapter_base, is_adapter_folder
from ckptkit.hub import hub_source, parse_ref
from ckptkit.io import AUTO, COPY_METHODS, check_replaceable
from ckptkit.plan import Options, Plan, check_experts_choice, plan_conversion, target_format
from ckptkit.tensors.casting import counted_casts
from ckptkit.tensors.dtypes import CAST_TARGETS
from ckptkit.writing import COMPUTED, publishing_output, write_plan

if TYPE_CHECKING:
    from ckptkit.verify import Report

__all__ = [
    "COMPUTED", "ConvertOptions", "Options", "Plan", "Result", "convert", "plan_conversion", "write_checkpoint",
    "write_files", "write_plan",
]  # fmt: skip

# --- the command ---------------------------------------------------------------------


def check_destination(src: Path, dst: Path, force: bool, fmt: CheckpointFormat | None = None) -> None:
    """A one-line error for a DST under a regular file, the source itself, inside it or
    holding it, (a folder DST) one that is not empty without ``force``, and (``fmt`` writes
    one file) one its file names do not match."""
    suffix = None if fmt is None else fmt.info.file_suffix
    blocking = next((p for p in dst.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CkptkitError(f"{dst}: {blocking} is a file, not a folder; choose a DST outside it")
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise CkptkitError(f"{dst}: the destination may not be the source or lie inside it")
    if d in s.parents:
        raise CkptkitError(f"{dst}: the destination contains the source; choose another directory")
    if fmt is not None:
        check_destination_name(fmt, dst)
    if suffix is None:
        check_replaceable(dst, force)


def check_destination_name(fmt: CheckpointFormat, dst: Path) -> None:
    """Bad usage (exit 2) in one line: a one-file format's DST not ending in its suffix, or a
    folder format's DST ending in the suffix of another format's one file (``--to hf x.gguf``)."""
    suffix = fmt.info.file_suffix
    if suffix is not None:
        if dst.suffix.lower() != suffix:
            raise FlagError(f"{dst}: --to {fmt.name} writes one file; name DST ending in {suffix}")
        return
    ending = dst.suffix.lower()  # a.GGUF is a GGUF file name too
    owner = next((f for f in REGISTRY.values() if f.info.file_suffix and f.info.file_suffix == ending), None)
    if owner is not None:
        raise FlagError(
            f"{dst}: a {owner.name} file name, but --to {fmt.name} writes a folder; "
            f"choose a DST not ending in {dst.suffix}, or pass --to {owner.name}"
        )


@dataclass
class Result:
    plan: Plan
    notes: list[str]
    bytes_written: int
    bytes_by_method: dict[str, int] = field(default_factory=dict)  # copy method (or COMPUTED) -> bytes
    source: str = ""  # a Hub source: which weight set of which commit (empty for a local path)


SIZE_UNITS = "KB, MB, GB, TB (powers of 1000)"


def parse_size(text: str) -> int:
    """``--max-shard-size``: a number and a unit, as transformers takes it (``5GB``, ``500MB``)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(text)
    except ValueError:
        raise FlagError(
            f"--max-shard-size {text}: not a size; write a number and one of {SIZE_UNITS}, e.g. 5GB or 500MB"
        ) from None
    if size <= 0:
        raise FlagError(f"--max-shard-size {text}: must be more than 0 bytes, e.g. 5GB")
    return size


def check_options(
    fmt: CheckpointFormat, dtype: str | None, shards: int | None, max_shard_size: str | None, allow_lossy_cast: bool
) -> None:
    """Refuse options that contradict each other or the target format, in one line each."""
    if allow_lossy_cast and dtype is None:
        raise FlagError("--allow-lossy-cast only applies to a cast: add --dtype TYPE, or drop --allow-lossy-cast")
    size_formats = ", ".join(n for n, f in REGISTRY.items() if f.info.sharding == "size")
    rank_formats = ", ".join(n for n, f in REGISTRY.items() if f.info.sharding == "ranks")
    if max_shard_size is not None:
        if fmt.info.sharding != "size":
            instead = "; split it with --shards N" if fmt.info.sharding == "ranks" else ""
            raise FlagError(
                f"--max-shard-size applies to --to {size_formats}, not --to {fmt.name} "
                f"({'model-parallel ranks' if fmt.info.sharding == 'ranks' else 'one layout'}){instead}"
            )
        parse_size(max_shard_size)
    if shards is not None and fmt.info.sharding != "ranks":
        instead = "; limit shard size with --max-shard-size SIZE" if fmt.info.sharding == "size" else ""
        raise FlagError(f"--shards (model-parallel ranks) applies to --to {rank_formats}, not --to {fmt.name}{instead}")


def check_gguf_pre(fmt: CheckpointFormat, name: str | None) -> None:
    """``--gguf-pre`` goes with a format that takes it (which checks the name)."""
    if name is not None and not fmt.info.takes_pre_tokenizer:
        takers = " or ".join(f"--to {f.name}" for f in REGISTRY.values() if f.info.takes_pre_tokenizer)
        raise FlagError(f"--gguf-pre (a llama.cpp pre-tokenizer) applies to {takers}, not --to {fmt.name}")


DEQUANTIZED_DTYPE = "bfloat16"  # what a quantized GGUF's tensors are read at without --dtype


def check_lossy(ckpt: Checkpoint, dtype: str | None) -> str | None:
    """The ``--dtype`` a source's tensors are read at: tensors it holds only approximately
    (quantized, a GGUF's blocks) are dequantized to ``dtype``, bfloat16 when none is given,
    and the conversion says so in one note."""
    lossy = ckpt.raw.lossy
    if not lossy:
        return dtype
    kinds = ", ".join(sorted(set(lossy.values())))
    how = dtype if dtype is not None else f"{DEQUANTIZED_DTYPE} (the default for quantized sources; --dtype TYPE)"
    fact = (
        f"lossy: {len(lossy)} quantized tensors ({kinds}) dequantized to {how}, llama.cpp's approximations "
        "of the original weights, not the weights themselves"
    )
    ckpt.notes.append(note(fact))
    return dtype if dtype is not None else DEQUANTIZED_DTYPE


def check_quant_options(quant: QuantOptions, dtype: str | None) -> None:
    """llama-quantize's options go with ``--to gguf --dtype`` one of its types; the GGML types
    they name must be ones ckptkit writes."""
    given = quant.given()
    if given and quantize_type(dtype) is None:
        names = ", ".join(n for n in FILE_TYPES if n not in CONVERTER_NAMES)
        raise FlagError(f"{given[0]} applies with --to gguf --dtype one of llama-quantize's types ({names})")
    if quant.output_tensor_type is not None:
        ggml_type(quant.output_tensor_type, "--output-tensor-type")
    if quant.token_embedding_type is not None:
        ggml_type(quant.token_embedding_type, "--token-embedding-type")


@dataclass
class ConvertOptions:
    """What a conversion is asked (the CLI's ``convert`` builds one from its options).

    ``to``: the target format; ``model_type`` that contradicts what the files say is refused
    unless ``force_model_type``; ``copy_method`` picks how tensors travel file to file (see
    :func:`write_plan`); ``config`` gives the model config of a source without one
    (``--config``); ``experts`` (``per-expert`` / ``stacked``) how a mixture-of-experts
    model's experts are stored (None: as in the source); ``base``: a LoRA adapter source's
    base checkpoint; ``on_verify`` receives ``--verify``'s report; ``tokenizer``
    (``--tokenizer``) gives the tokenizer files, in place of the source's own (see
    :func:`~ckptkit.checkpoint.tokenizer_from`); ``gguf_pre`` (``--gguf-pre``, ``--to gguf``
    only) names the pre-tokenizer of a byte-level BPE tokenizer llama.cpp does not recognise;
    ``quant``: llama-quantize's options (``--imatrix`` ...), with a ``--dtype`` of its types.
    """

    to: str
    from_format: str | None = None
    model_type: str | None = None
    dtype: str | None = None
    shards: int | None = None
    max_shard_size: str | None = None
    force: bool = False
    verify: bool = False
    quiet: bool = True
    on_verify: Callable[[Report], None] | None = None
    copy_method: str | None = AUTO
    allow_lossy_cast: bool = False
    config: str | Path | None = None
    force_model_type: bool = False
    experts: str | None = None
    base: str | Path | None = None
    tokenizer: str | Path | None = None
    gguf_pre: str | None = None
    quant: QuantOptions = field(default_factory=QuantOptions)
    stream: bool = False

    def plan_options(self) -> Options:
        """What the target format plans from."""
        return Options(
            self.to,
            self.dtype,
            self.shards,
            self.max_shard_size,
            self.allow_lossy_cast,
            self.experts,
            self.gguf_pre,
            self.quant,
        )


_P = ParamSpec("_P")


def _noting_underflows(fn: Callable[_P, Result]) -> Callable[_P, Result]:
    """``fn`` with the underflows of all its casts counted into one note on its result."""

    @functools.wraps(fn)
    def counted(*args: _P.args, **kwargs: _P.kwargs) -> Result:
        with counted_casts() as underflows:
            result = fn(*args, **kwargs)
        result.notes.extend(underflows.notes())
        return result

    return counted


@_noting_underflows
def convert(src: str | Path, dst: str | Path, opts: ConvertOptions) -> Result:
    """Convert ``src`` into ``dst`` as ``opts`` asks; ``dst`` is complete or absent afterwards.

    A PEFT LoRA adapter folder ``src`` goes to a format that holds adapters
    (:func:`convert_adapter`), ``opts.base`` its base checkpoint.
    """
    src, dst = Path(src), Path(dst)
    o = opts
    if o.copy_method is not None and o.copy_method not in COPY_METHODS:
        raise FlagError(f"--copy-method must be one of {', '.join(COPY_METHODS)}, not {o.copy_method!r}")
    fmt = target_format(o.to)
    if o.dtype is not None:  # llama-quantize's names in any case (q4_k_m: Q4_K_M)
        known = {d.lower(): d for d in CAST_TARGETS + fmt.info.extra_dtypes}
        o = replace(o, dtype=known.get(o.dtype.lower(), o.dtype))
        if set(FILE_TYPES) & set(fmt.info.extra_dtypes):
            quantize_type(o.dtype)  # llama-quantize's types not written yet: one line saying so
    if o.dtype is not None and o.dtype not in CAST_TARGETS + fmt.info.extra_dtypes:
        spelled = {d.lower(): d for f in REGISTRY.values() for d in f.info.extra_dtypes}
        takers = [f.name for f in REGISTRY.values() if spelled.get(o.dtype.lower()) in f.info.extra_dtypes]
        if takers:
            raise FlagError(f"--dtype {spelled[o.dtype.lower()]} applies only to --to {' or '.join(takers)}")
        raise FlagError(f"--dtype must be one of {', '.join(CAST_TARGETS)}, not {o.dtype!r}")
    if o.shards is not None and o.shards < 1:
        raise FlagError("--shards must be at least 1")
    check_options(fmt, o.dtype, o.shards, o.max_shard_size, o.allow_lossy_cast)
    check_gguf_pre(fmt, o.gguf_pre)
    check_quant_options(o.quant, o.dtype if set(FILE_TYPES) & set(fmt.info.extra_dtypes) else None)
    if parse_ref(src) is None:
        return _convert_local(src, dst, fmt, o)
    check_destination(src, dst, o.force, fmt)  # before a byte of the source is fetched
    with hub_source(src, from_format=o.from_format, model_type=o.model_type, stream=o.stream, quiet=o.quiet) as got:
        result = _convert_local(got.path, dst, fmt, replace(o, from_format=got.from_format))
        result.source = got.describe()
        return result


def _convert_local(src: Path, dst: Path, fmt: CheckpointFormat, o: ConvertOptions) -> Result:
    """:func:`convert` of a source on this disk (or mounted: a streamed Hub source)."""
    if src.is_dir() and is_adapter_folder(src):
        return convert_adapter(src, dst, fmt, o)
    if o.base is not None and src.exists():
        raise CkptkitError(f"--base applies to a LoRA adapter SRC (a folder with {ADAPTER_CONFIG}); {src} is not one")
    opened = open_checkpoint(src, o.from_format, o.model_type, o.config, check_model_type=not o.force_model_type)
    with opened, tokenizer_from(opened, o.tokenizer) as ckpt:
        o = replace(o, dtype=check_lossy(ckpt, o.dtype))
        check_experts_choice(ckpt, fmt, o.experts)
        check_destination(src, dst, o.force, fmt)
        return write_checkpoint(ckpt, dst, o.plan_options(), o.verify, o.quiet, o.on_verify, o.copy_method, o.force)


def convert_adapter(src: Path, dst: Path, fmt: CheckpointFormat, opts: ConvertOptions) -> Result:
    """The PEFT LoRA adapter folder ``src`` as ``fmt``'s adapter file ``dst`` (``opts.base``: its base)."""
    if not fmt.info.writes_adapters:
        takers = " or ".join(f"--to {f.name}" for f in REGISTRY.values() if f.info.writes_adapters)
        raise CkptkitError(
            f"{src}: a LoRA adapter; --to {fmt.name} takes models. Convert the adapter {takers}, or fold it into "
            f"its base with ckptkit merge BASE {src} MERGED"
        )
    given = {"--from": opts.from_format, "--model-type": opts.model_type, "--config": opts.config}
    given["--tokenizer"], given["--gguf-pre"] = opts.tokenizer, opts.gguf_pre
    extra = next((flag for flag, value in given.items() if value is not None), None)
    extra = extra or ("--experts" if opts.experts is not None else "--verify" if opts.verify else None)
    if extra is not None:
        raise FlagError(f"{extra} applies to checkpoints, not to a LoRA adapter SRC")
    check_destination(src, dst, opts.force, fmt)
    base = Path(opts.base) if opts.base is not None else None
    with open_checkpoint(adapter_base(src, base)) as trained_on:
        plan = fmt.plan_adapter(src, trained_on, opts.plan_options())
    with publishing_output(fmt, dst, opts.force) as tmp:
        by_method = write_plan(plan, tmp, opts.quiet)
    return Result(plan, plan.notes, _size(dst), by_method)


def write_checkpoint(
    ckpt: Checkpoint,
    dst: Path,
    opts: Options,
    verify: bool = False,
    quiet: bool = True,
    on_verify: Callable[[Report], None] | None = None,
    copy_method: str | None = AUTO,
    force: bool = False,
) -> Result:
    """Write ``ckpt`` to ``dst`` (replaced only with ``force``), published atomically."""
    plan = plan_conversion(ckpt, opts)
    with publishing_output(target_format(plan.format), dst, force) as tmp:
        by_method = write_files(ckpt, plan, tmp, quiet, copy_method)
        if verify:
            from ckptkit.verify import verify_against

            report = verify_against(ckpt, tmp, plan.format, plan.verify_cast, quiet=quiet, left_out=plan.left_out)
            if on_verify:
                on_verify(report)
            if not _as_planned(plan, report):
                raise CkptkitError(f"{dst}: verification failed: {report.summary()}")
    return Result(plan, ckpt.notes + plan.notes, _size(dst), by_method)


def _as_planned(plan: Plan, report: Report) -> bool:
    """Whether the output read back is the source as ``plan`` writes it: bitwise equal, or
    differing only where the format stores tensors approximately (GGUF's types)."""
    if report.ok:
        return True
    if report.only_in_a or report.only_in_b:
        return False
    return all(
        d.kind == "dequantized"  # every quantized byte comes back: the reference dequantization
        or (d.kind == "quantized" and plan.quant_config is not None)  # --dtype fp8 quantized it
        or plan.approximates(d.name_b.split(" (part ")[0], d.kind, d.rounded_to)
        for d in report.differences
    )


def _size(dst: Path) -> int:
    """The bytes of the output ``dst``: one file, or the files of a folder."""
    if dst.is_file():
        return dst.stat().st_size
    return sum(p.stat().st_size for p in dst.iterdir() if p.is_file())


def write_files(
    ckpt: Checkpoint, plan: Plan, out: Path, quiet: bool = True, copy_method: str | None = AUTO
) -> dict[str, int]:
    """Every file of the converted checkpoint, into an existing (temporary) folder, or the
    one file of a one-file format; returns the bytes written per copy method (see
    :func:`write_plan`)."""
    by_method = write_plan(plan, out, quiet, copy_method=copy_method)
    target_format(plan.format).finish(ckpt, plan, out)
    return by_method
