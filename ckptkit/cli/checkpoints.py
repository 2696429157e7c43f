"""The commands that read and write checkpoints: ``inspect``, ``convert``, ``verify``, ``support``."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ckptkit.cli.app import (
    CHOICES_MARK,
    CONFIG_HELP,
    DEFAULT_COPY_METHOD,
    MODEL_TYPE_HELP,
    NO_COPY,
    NOTHING_WRITTEN,
    Command,
    app,
    err,
    human,
    logging_to_stderr,
    out,
    user_errors,
)

if TYPE_CHECKING:
    from ckptkit.verify import Report

SRC_HELP = (
    "Source checkpoint: a folder, or a file for single-file formats (never modified); or a Hub repository: "
    "org/name, org/name@REVISION, hf://org/name[@REVISION]/SUBFOLDER (a local path that exists wins)."
)
STREAM_HELP = "A Hub source: read its weights by HTTP range requests, keeping no copy (no download into the cache)."
DST_HELP = "Destination: a folder (must not exist or be empty), or a file for single-file formats (must not exist)."


@app.command(cls=Command)
@user_errors
def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="Checkpoint directory or one weight / index file, or a Hub repository (org/name[@REVISION]): "
            "its headers only, by HTTP range requests.",
        ),
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model_type: Annotated[str | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help=CONFIG_HELP)] = None,
) -> None:
    """List format, model type, dtypes and tensors; reads metadata only."""
    from ckptkit.inspection import inspect_path

    info = inspect_path(path, model_type, config)
    if json_out:
        sys.stdout.write(json.dumps(info) + "\n")
        return
    dtypes = Counter(t["dtype"] for t in info["tensors"])
    out.print(f"[bold]{path}[/bold]")
    if info.get("source"):
        out.print(f"hub         {info['source']}", highlight=False, markup=False)
    out.print(f"format      {info['format']}")
    out.print(f"model type  {info['model_type'] or 'unknown'}")
    out.print(f"dtypes      {', '.join(f'{d} ({n})' for d, n in dtypes.most_common())}")
    out.print(f"tensors     {len(info['tensors'])}")
    out.print(f"parameters  {info['num_params']:,}")
    out.print(f"bytes       {info['total_bytes']:,} ({human(info['total_bytes'])})")
    out.print(f"files       {', '.join(info['files'])}")
    if q := info.get("quantization"):
        block = q["block"] if isinstance(q["block"], str) else "x".join(map(str, q["block"]))
        out.print(
            f"quantized   {q['method']}: {q['quantized_tensors']} weights {q['stored']} in {block} blocks, "
            f"{q['scales']} scales; dequantized: {q['dequantized']} (--dtype chooses)"
        )
    if info.get("ignored"):
        out.print(f"not model   {len(info['ignored'])} entries, not converted: {', '.join(info['ignored'][:6])}")
    if not out.is_terminal:  # piped: full names on one line each, for grep and friends
        out.width = 1000
    for part in tensor_tables(info["tensors"], out.width):
        out.print(part, highlight=False, markup=False)


def tensor_tables(tensors: list[dict[str, Any]], width: int) -> list[Table | str]:
    """``inspect``'s tensor table, each row on one line of ``width`` columns with the name
    whole (copyable): name, shape, dtype and file; where the file does not fit beside the
    rest, one table of name, shape and dtype per file, under the file's name; where even those
    do not fit, each name on a line of its own, its shape and dtype on the next."""
    rows: list[tuple[str, ...]] = [
        (t["name"], "[" + ", ".join(map(str, t["shape"])) + "]", t["dtype"], t["file"]) for t in tensors
    ]
    headers = ("name", "shape", "dtype", "file")

    def table(columns: int, items: list[tuple[str, ...]]) -> Table:
        made = Table(box=None, header_style="bold")
        for header in headers[:columns]:
            made.add_column(header, no_wrap=True)
        for row in items:
            made.add_row(*row[:columns])
        return made

    widest = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    if sum(widest) + 2 * len(headers) <= width:  # rich pads each cell by one on both sides
        return [table(4, rows)]
    by_file: dict[str, list[tuple[str, ...]]] = {}
    for row in rows:
        by_file.setdefault(row[3], []).append(row)
    if sum(widest[:3]) + 2 * 3 <= width:
        return [part for file, items in by_file.items() for part in (f"{file}:", table(3, items))]
    # not even name, shape and dtype side by side: each name on its own line, whole
    lines = {file: [f"{r[0]}\n    {r[1]}  {r[2]}" for r in items] for file, items in by_file.items()}
    return [part for file, items in lines.items() for part in (f"{file}:", *items)]


@app.command(cls=Command)
@user_errors(stopped=NOTHING_WRITTEN)
def convert(
    src: Annotated[Path, typer.Argument(metavar="SRC", help=SRC_HELP)],
    dst: Annotated[Path, typer.Argument(metavar="DST", help=DST_HELP)],
    to: Annotated[str, typer.Option("--to", metavar="FORMAT", help=f"Target format: {CHOICES_MARK}.")],
    from_: Annotated[
        str | None,
        typer.Option("--from", metavar="FORMAT", help=f"Source format (default: detected): {CHOICES_MARK}."),
    ] = None,
    model_type: Annotated[str | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            metavar="DTYPE",
            help=f"Cast floating tensors to {CHOICES_MARK} (default: keep every dtype and byte).",
        ),
    ] = None,
    shards: Annotated[
        int | None, typer.Option(metavar="N", help="Meta model-parallel ranks, or DCP rank files, to write.")
    ] = None,
    max_shard_size: Annotated[
        str | None, typer.Option(metavar="SIZE", help='HF shard size limit, e.g. "5GB" (default 5GB).')
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty destination.")] = False,
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help=CONFIG_HELP)] = None,
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-read the output and compare it with SRC, tensor by tensor.")
    ] = False,
    allow_lossy_cast: Annotated[
        bool,
        typer.Option("--allow-lossy-cast", help="Let --dtype overflow values to inf (an error otherwise)."),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or summary.")] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object on stdout (what was written, seconds, peak memory, notes); no bar."
        ),
    ] = False,
    force_model_type: Annotated[
        bool,
        typer.Option("--force-model-type", help="Use --model-type even where the files describe another type."),
    ] = False,
    copy_method: Annotated[
        str,
        typer.Option(
            metavar="METHOD",
            help=f"How tensors go file to file: {CHOICES_MARK} (auto: direct past the page cache "
            "for outputs over the kernel's dirty limit, else stream through it; off: through memory).",
        ),
    ] = DEFAULT_COPY_METHOD,
    verbose: Annotated[
        bool, typer.Option(help="Log how the output is written (ckptkit.io) and the bytes of each copy method.")
    ] = False,
    experts: Annotated[
        str | None,
        typer.Option(
            metavar="LAYOUT",
            help=f"Mixture-of-experts models: store experts one tensor each or as 3-D stacks in DST: {CHOICES_MARK} "
            "(default: as in SRC).",
        ),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option(
            "--base",
            metavar="BASE",
            help="SRC a LoRA adapter folder: the base checkpoint it was trained on (default: the adapter "
            "config's base_model_name_or_path, if a local folder).",
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            metavar="PATH",
            help="The tokenizer, for a SRC without one (DCP) or in place of its own: a tokenizer.model or "
            "tokenizer.json, or a folder with the HF tokenizer files and/or tokenizer.model.",
        ),
    ] = None,
    stream: Annotated[bool, typer.Option("--stream", help=STREAM_HELP)] = False,
    gguf_pre: Annotated[
        str | None,
        typer.Option(
            "--gguf-pre",
            metavar="NAME",
            help="With --to gguf: the llama.cpp pre-tokenizer (tokenizer.ggml.pre, e.g. llama-bpe, qwen2) of a "
            "byte-level BPE tokenizer llama.cpp does not recognise (an edited one); a wrong NAME lists them.",
        ),
    ] = None,
    imatrix: Annotated[
        Path | None,
        typer.Option(
            "--imatrix",
            metavar="FILE",
            help="With --to gguf --dtype Q4_K_M etc.: llama.cpp's importance matrix (GGUF or legacy .dat), as "
            "llama-quantize --imatrix uses it.",
        ),
    ] = None,
    output_tensor_type: Annotated[
        str | None,
        typer.Option(
            "--output-tensor-type",
            metavar="GGML_TYPE",
            help="With --dtype Q4_K_M etc.: output.weight's GGML type (as llama-quantize's option).",
        ),
    ] = None,
    token_embedding_type: Annotated[
        str | None,
        typer.Option(
            "--token-embedding-type",
            metavar="GGML_TYPE",
            help="With --dtype Q4_K_M etc.: token_embd.weight's GGML type (as llama-quantize's option).",
        ),
    ] = None,
    pure: Annotated[
        bool,
        typer.Option("--pure", help="With --dtype Q4_K_M etc.: no mix, every quantized tensor the type's own."),
    ] = False,
    leave_output_tensor: Annotated[
        bool,
        typer.Option("--leave-output-tensor", help="With --dtype Q4_K_M etc.: output.weight left unquantized."),
    ] = False,
) -> None:
    """Convert SRC to DST in another format, streaming one tensor at a time (SRC may be a LoRA adapter: see --base)."""
    from ckptkit.convert import COMPUTED, ConvertOptions
    from ckptkit.convert import convert as run_convert
    from ckptkit.formats.base import QuantOptions

    start = time.perf_counter()
    reports: list[Report] = []
    with logging_to_stderr("ckptkit", logging.INFO if verbose else None):
        opts = ConvertOptions(
            to,
            from_format=from_,
            model_type=model_type,
            dtype=dtype,
            shards=shards,
            max_shard_size=max_shard_size,
            force=force,
            verify=verify,
            quiet=quiet or json_out,
            on_verify=reports.append,
            copy_method=None if copy_method == NO_COPY else copy_method,
            allow_lossy_cast=allow_lossy_cast,
            config=config,
            force_model_type=force_model_type,
            experts=experts,
            base=base,
            tokenizer=tokenizer,
            gguf_pre=gguf_pre,
            quant=QuantOptions(
                None if imatrix is None else str(imatrix),
                output_tensor_type,
                token_embedding_type,
                pure,
                leave_output_tensor,
            ),
            stream=stream,
        )
        result = run_convert(src, dst, opts)
    if json_out:
        summary = written_summary(dst, to, result.bytes_written, time.perf_counter() - start, result.notes)
        if result.source:
            summary["source"] = result.source
        if verify:
            summary["verify"] = {"verdict": reports[0].to_json()["verdict"], "line": _verified(dtype, reports)}
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    if quiet:
        return
    if result.source:
        err.print(f"from the Hub: {result.source}", highlight=False)
    for note in result.notes:
        err.print(f"note: {note}", highlight=False)
    files = len(result.plan.files)
    layout = "restored the source layout" if result.plan.restored else f"{files} weight file{'s' * (files != 1)}"
    tensor_bytes = sum(result.bytes_by_method.values())
    copied = tensor_bytes - result.bytes_by_method.get(COMPUTED, 0)
    share = f", {copied / tensor_bytes:.0%} of tensor bytes copied file to file" if tensor_bytes else ""
    err.print(
        f"wrote {dst} ({to}, {layout}, {human(result.bytes_written)}{share}) "
        f"in {time.perf_counter() - start:.1f}s" + (f"; {_verified(dtype, reports)}" if verify else ""),
        highlight=False,
    )
    if verbose:
        ways = ", ".join(f"{method} {human(n)}" for method, n in sorted(result.bytes_by_method.items()))
        err.print(f"tensor bytes by method: {ways or 'none'}", highlight=False)


def written_summary(dst: Path, fmt: str, nbytes: int, seconds: float, notes: list[str]) -> dict[str, Any]:
    """``convert --json``'s object: DST, its format, files and bytes, the seconds taken, the
    process's peak resident memory (``getrusage``'s ``ru_maxrss``) in bytes, the notes."""
    import resource

    files = sorted(p.name for p in dst.iterdir() if p.is_file()) if dst.is_dir() else [dst.name]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {
        "path": str(dst),
        "format": fmt,
        "files": files,
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "peak_rss_bytes": peak,
        "notes": notes,
    }


def _verified(dtype: str | None, reports: list[Report]) -> str:
    """What ``--verify`` found: bitwise (or the cast asked), else verify's verdict on the
    differences the format's stored types make (GGUF's)."""
    from ckptkit.tensors.casting import cast_description

    if reports and not reports[0].ok:
        return f"verified against the source: {reports[0].verdict().split(';')[0]}"
    return cast_description(dtype) if dtype else "verified bitwise against the source"


@app.command(cls=Command)
@user_errors
def verify(
    a: Annotated[Path, typer.Argument(metavar="A", help="First checkpoint (any format; or a Hub repository).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Second checkpoint (any format; or a Hub repository).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    allow_cast: Annotated[
        bool,
        typer.Option(
            "--allow-cast", help="Accept tensors that are the same values in another dtype, or rounded to it."
        ),
    ] = False,
    logits: Annotated[
        bool,
        typer.Option(
            "--logits", help="Also run both models on fixed prompts: max abs logit difference and KL divergence."
        ),
    ] = False,
    stream: Annotated[bool, typer.Option("--stream", help=STREAM_HELP)] = False,
) -> None:
    """Compare two checkpoints tensor by tensor, bitwise, in each one's own names.

    The first line is the verdict (IDENTICAL, CAST: only dtypes differ, or DIFFERENT).
    Exit status: 0 identical (or only casts, with --allow-cast); 1 otherwise.
    """
    from ckptkit.hub import hub_source
    from ckptkit.verify import verify_paths

    with hub_source(a, stream=stream, quiet=json_out) as ra, hub_source(b, stream=stream, quiet=json_out) as rb:
        report = verify_paths(ra.path, rb.path, quiet=json_out)
        if logits:  # both through the native decoder
            from ckptkit.train.logit_check import compare_logits

            report.logits = compare_logits(ra.path, rb.path, report.model_type)
    if json_out:
        sys.stdout.write(json.dumps(report.to_json(allow_cast)) + "\n")
    else:
        out.print(report.verdict(allow_cast), highlight=False, markup=False)
        for name in report.only_in_a:
            out.print(f"only in {a}: {name}", highlight=False, markup=False)
        for name in report.only_in_b:
            out.print(f"only in {b}: {name}", highlight=False, markup=False)
        for d in report.differences:
            out.print(
                f"{'cast' if d.kind in ('cast', 'rounded') else 'differs'}: {d.describe()}",
                highlight=False,
                markup=False,
            )
        if report.ignored:
            out.print(
                f"not compared (unused by the model): {', '.join(report.ignored[:4])}", highlight=False, markup=False
            )
        if report.logits is not None:
            from ckptkit.train.logit_check import describe

            out.print(describe(report.logits), highlight=False, markup=False)
    code = report.exit_code(allow_cast)
    if code:
        raise typer.Exit(code)


@app.command(cls=Command)
@user_errors
def support(json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Which model types each format reads and writes, and what happens to the tokenizer.

    Made from the format and model registries; docs/support.md is this output.
    """
    from ckptkit.support import support_markdown, support_matrix

    if json_out:
        sys.stdout.write(json.dumps(support_matrix()) + "\n")
    else:
        sys.stdout.write(support_markdown())
