"""The ``ckptkit`` command line: thin wrappers that parse, call the library and render."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ckptkit import __version__
from ckptkit.errors import CkptkitError
from ckptkit.formats import FORMATS
from ckptkit.io import AUTO, COPY_METHODS
from ckptkit.models import MODEL_TYPES

app = typer.Typer(
    name="ckptkit",
    help="Lossless conversion of LLM checkpoints between Meta, Hugging Face and ckptkit formats.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])


# Choices come from the registries: a new format or family appears here by itself.
Format = StrEnum("Format", {name.replace("-", "_"): name for name in FORMATS})  # type: ignore[misc]
ModelType = StrEnum("ModelType", {name: name for name in MODEL_TYPES})  # type: ignore[misc]


NO_COPY = "off"
# auto, direct, stream, off: the fallbacks auto picks by itself (gather, copy_file_range...)
# are not for users to choose; --verbose shows which were used
CopyMethod = StrEnum("CopyMethod", {m: m for m in (*COPY_METHODS, NO_COPY)})  # type: ignore[misc]


class DType(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def user_errors(fn: F) -> F:
    """Turn CkptkitError (and I/O failures) into one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CkptkitError as e:
            err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(1) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            err.print(f"[red]error:[/red] {where}{e.strerror or e}", markup=True, highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("interrupted; nothing was written to the destination")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        out.print(f"ckptkit {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Lossless conversion of LLM checkpoints between Meta, Hugging Face and ckptkit formats."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@app.command()
@user_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory or one weight / index file.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model_type: Annotated[ModelType | None, typer.Option(help="Override model type detection.")] = None,
) -> None:
    """List format, model type, dtypes and tensors; reads metadata only."""
    from ckptkit.inspection import inspect_path

    info = inspect_path(path, model_type.value if model_type else None)
    if json_out:
        sys.stdout.write(json.dumps(info) + "\n")
        return
    dtypes = Counter(t["dtype"] for t in info["tensors"])
    out.print(f"[bold]{path}[/bold]")
    out.print(f"format      {info['format']}")
    out.print(f"model type  {info['model_type'] or 'unknown'}")
    out.print(f"dtypes      {', '.join(f'{d} ({n})' for d, n in dtypes.most_common())}")
    out.print(f"tensors     {len(info['tensors'])}")
    out.print(f"parameters  {info['num_params']:,}")
    out.print(f"bytes       {info['total_bytes']:,} ({_human(info['total_bytes'])})")
    out.print(f"files       {', '.join(info['files'])}")
    table = Table(box=None, header_style="bold")
    table.add_column("name", overflow="fold")
    for column in ("shape", "dtype", "file"):
        table.add_column(column, no_wrap=True)
    if not out.is_terminal:  # piped: full names on one line each, for grep and friends
        out.width = 1000
    for t in info["tensors"]:
        table.add_row(t["name"], "[" + ", ".join(map(str, t["shape"])) + "]", t["dtype"], t["file"])
    out.print(table)


@app.command()
@user_errors
def convert(
    src: Annotated[Path, typer.Argument(help="Source checkpoint directory (never modified).")],
    dst: Annotated[Path, typer.Argument(help="Destination directory (must not exist or be empty).")],
    to: Annotated[Format, typer.Option("--to", help="Target format.")],
    from_: Annotated[Format | None, typer.Option("--from", help="Force the source format.")] = None,
    model_type: Annotated[ModelType | None, typer.Option(help="Override model type detection.")] = None,
    dtype: Annotated[
        DType | None, typer.Option(help="Cast floating tensors (default: keep every dtype and byte).")
    ] = None,
    shards: Annotated[int | None, typer.Option(help="Meta model-parallel ranks to write.")] = None,
    max_shard_size: Annotated[str | None, typer.Option(help='HF shard size limit, e.g. "5GB".')] = None,
    force: Annotated[bool, typer.Option(help="Replace a non-empty destination.")] = False,
    verify: Annotated[bool, typer.Option(help="Re-read the output and compare it with SRC, tensor by tensor.")] = False,
    allow_lossy_cast: Annotated[
        bool, typer.Option(help="Let --dtype overflow values to inf or flush them to 0 (an error otherwise).")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar or summary.")] = False,
    copy_method: Annotated[
        CopyMethod,
        typer.Option(
            help="How tensors go file to file (auto: direct past the page cache for outputs over the kernel's "
            "dirty limit, else stream through it; off: through memory)."
        ),
    ] = CopyMethod(AUTO),
    verbose: Annotated[
        bool, typer.Option(help="Log how the output is written (ckptkit.io) and the bytes of each copy method.")
    ] = False,
) -> None:
    """Convert SRC to DST in another format, streaming one tensor at a time."""
    from ckptkit.convert import COMPUTED
    from ckptkit.convert import convert as run_convert

    start = time.perf_counter()
    with _logging_to_stderr("ckptkit", logging.INFO if verbose else None):
        result = run_convert(
            src,
            dst,
            to.value,
            from_format=from_.value if from_ else None,
            model_type=model_type.value if model_type else None,
            dtype=dtype.value if dtype else None,
            shards=shards,
            max_shard_size=max_shard_size,
            force=force,
            verify=verify,
            quiet=quiet,
            copy_method=None if copy_method == NO_COPY else copy_method.value,
            allow_lossy_cast=allow_lossy_cast,
        )
    if quiet:
        return
    for note in result.notes:
        err.print(f"note: {note}", highlight=False)
    files = len(result.plan.files)
    layout = "restored the source layout" if result.plan.restored else f"{files} weight file{'s' * (files != 1)}"
    tensor_bytes = sum(result.bytes_by_method.values())
    copied = tensor_bytes - result.bytes_by_method.get(COMPUTED, 0)
    share = f", {copied / tensor_bytes:.0%} of tensor bytes copied file to file" if tensor_bytes else ""
    err.print(
        f"wrote {dst} ({to.value}, {layout}, {_human(result.bytes_written)}{share}) "
        f"in {time.perf_counter() - start:.1f}s" + (f"; {_verified(dtype.value if dtype else None)}" if verify else ""),
        highlight=False,
    )
    if verbose:
        ways = ", ".join(f"{method} {_human(n)}" for method, n in sorted(result.bytes_by_method.items()))
        err.print(f"tensor bytes by method: {ways or 'none'}", highlight=False)


@contextlib.contextmanager
def _logging_to_stderr(name: str, level: int | None) -> Iterator[None]:
    """While in the block, the records of logger ``name`` at ``level`` and above go to
    stderr, one line each (nothing changes when ``level`` is None)."""
    if level is None:
        yield
        return
    logger, handler = logging.getLogger(name), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def _verified(dtype: str | None) -> str:
    from ckptkit.casting import cast_description

    return cast_description(dtype) if dtype else "verified bitwise against the source"


@app.command()
@user_errors
def verify(
    a: Annotated[Path, typer.Argument(help="First checkpoint (any format).")],
    b: Annotated[Path, typer.Argument(help="Second checkpoint (any format).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compare two checkpoints tensor by tensor, bitwise, in canonical names."""
    from ckptkit.verify import verify_paths

    report = verify_paths(a, b, quiet=json_out)
    if json_out:
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
    else:
        for name in report.only_in_a:
            out.print(f"only in {a}: {name}", highlight=False)
        for name in report.only_in_b:
            out.print(f"only in {b}: {name}", highlight=False)
        for d in report.differences:
            out.print(f"differs: {d.describe()}", highlight=False)
        if report.ignored:
            out.print(f"not compared (unused by the model): {', '.join(report.ignored[:4])}", highlight=False)
        verdict = "identical" if report.ok else "DIFFERENT"
        out.print(f"{verdict}: {report.identical} of {report.compared} common tensors bitwise equal", highlight=False)
    if not report.ok:
        raise typer.Exit(1)


# --- recipes: run, ls, cp --------------------------------------------------------------


@app.command(context_settings={"allow_extra_args": False})
@user_errors
def run(
    recipe: Annotated[str, typer.Argument(help="Bundled recipe (see `ckptkit ls`) or a recipe .py file.")],
    config: Annotated[str, typer.Option("--config", help="Bundled config name or a YAML path.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="KEY=VALUE overrides, e.g. optimizer.lr=3e-4")] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", min=1, help="Start this many processes with torchrun (distributed recipes)."),
    ] = None,
) -> None:
    """Run a training recipe with a config and KEY=VALUE overrides."""
    from ckptkit.train.config import load_config
    from ckptkit.train.recipes import launch_torchrun, recipe_entry

    entry = recipe_entry(recipe)
    cfg = load_config(config, overrides or [])
    if nproc_per_node is None:
        entry(cfg)
    else:
        launch_torchrun(recipe, nproc_per_node, config, overrides or [], cfg)


@app.command(name="ls")
@user_errors
def list_recipes() -> None:
    """List the bundled recipes and their configs."""
    from ckptkit.train.recipes import RECIPES

    table = Table("recipe", "configs", box=None, header_style="bold")
    for name, configs in RECIPES.items():
        table.add_row(name, ", ".join(configs))
    out.print(table)


@app.command()
@user_errors
def cp(
    name: Annotated[str, typer.Argument(help="A bundled recipe or config name (see `ckptkit ls`).")],
    dest: Annotated[Path, typer.Argument(help="File or directory to copy it to.")],
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Copy a bundled recipe (.py) or config (.yaml) out for editing."""
    import shutil

    from ckptkit.train.config import bundled_configs
    from ckptkit.train.recipes import RECIPE_DIR, RECIPES

    if name in RECIPES:
        src = RECIPE_DIR / f"{name}.py"
    elif name in bundled_configs():
        src = bundled_configs()[name]
    else:
        raise CkptkitError(f"{name}: no bundled recipe or config of that name (see `ckptkit ls`)")
    target = dest / src.name if dest.is_dir() else dest
    if target.exists() and not force:
        raise CkptkitError(f"{target}: already exists (pass --force to overwrite)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    err.print(f"copied {name} to {target}", highlight=False)


# --- generate (native model; body in ckptkit/train/generation.py) -------------------------------


@app.command()
@user_errors
def generate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (any format) with a tokenizer.")],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(min=1, help="Sample from the k most likely tokens.")] = None,
    adapter: Annotated[Path | None, typer.Option(help="PEFT LoRA adapter directory to apply.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.")] = 0,
    chat: Annotated[
        bool, typer.Option("--chat", help="PROMPT is a user message: apply the chat template; print the reply.")
    ] = False,
) -> None:
    """Continue PROMPT with the native model (KV-cached greedy or sampled decoding), streamed as it comes.

    Prompt plus completion are capped at the model's context length. With --chat, PROMPT is
    rendered with the checkpoint's chat template (tokenizer_config.json) and only the reply
    is printed.
    """
    from ckptkit.train.generation import generate_text

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    generate_text(
        str(checkpoint), prompt, max_new_tokens, temperature, top_k, str(adapter) if adapter else None, seed,
        on_text=write, on_note=lambda note: err.print(f"note: {note}", highlight=False), chat=chat,
    )  # fmt: skip
    sys.stdout.write("\n")


# --- end generate --------------------------------------------------------------------------------


@app.command()
@user_errors
def merge(
    base: Annotated[Path, typer.Argument(help="The base checkpoint the adapter was trained on (any format).")],
    adapter: Annotated[Path, typer.Argument(help="PEFT LoRA adapter directory, e.g. out/step_500/adapter.")],
    dst: Annotated[Path, typer.Argument(help="Destination directory (must not exist or be empty).")],
    model_type: Annotated[ModelType | None, typer.Option(help="Override model type detection.")] = None,
) -> None:
    """Fold a LoRA adapter into its base: DST has the base's format, files and shards, merged weights."""
    from ckptkit.train.export import merge_adapter_into_checkpoint

    merge_adapter_into_checkpoint(base, adapter, dst, model_type.value if model_type else None)
    err.print(f"wrote {dst} (the merged model)", highlight=False)
