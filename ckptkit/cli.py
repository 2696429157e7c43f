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
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from typer._click.exceptions import UsageError
from typer.core import TyperCommand

from ckptkit import __version__
from ckptkit.errors import CkptkitError
from ckptkit.formats import format_names
from ckptkit.io import AUTO, COPY_METHODS
from ckptkit.models import MODEL_TYPES


class OneLineUsageError(UsageError):
    """Bad usage told in one line (exit 2), without the usage preamble."""

    def show(self, file: Any = None) -> None:
        sys.stderr.write(f"error: {self.format_message()}\n")


def _choices(param: Any) -> list[str]:
    """The values an enum-typed option takes ([] for other options)."""
    import typing

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, Enum):
            return [str(m.value) for m in t]
    return []


# What users type for a choice, and the choice they mean.
ALIASES = {
    "huggingface": "hf", "hugging-face": "hf", "transformers": "hf", "safetensors": "hf",
    "hf-safetensors": "hf", "bin": "hf-bin", "pytorch": "hf-bin", "hf_bin": "hf-bin",
    "llama": "meta", "consolidated": "meta", "bf16": "bfloat16", "fp16": "float16",
    "half": "float16", "fp32": "float32", "float": "float32",
}  # fmt: skip


def check_choices(params: list[Any], args: list[str]) -> None:
    """An unknown value of a choice option, refused in one line that lists the valid ones
    and the closest (``--to huggingface``: did you mean 'hf'?)."""
    import difflib

    for param in params:
        choices = _choices(param) if getattr(param, "param_type_name", "") == "option" else []
        if not choices:
            continue
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag not in param.opts:
                continue
            if not eq:
                if i + 1 >= len(args):
                    break
                value = args[i + 1]
            if value in choices:
                continue
            close = [ALIASES[value.lower()]] if ALIASES.get(value.lower()) in choices else []
            close = close or difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.4)
            close = close or [c for c in choices if c.startswith(value.lower()[:2])][:1]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise OneLineUsageError(f"{flag} {value}: not one of {', '.join(choices)}{hint}")


class Command(TyperCommand):
    """A command whose usage line names its arguments as the docs do (``SRC DST``), and
    whose unknown choices get one line with a did-you-mean."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "-h" not in args and "--help" not in args:
            check_choices(self.get_params(ctx), args)
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces.extend(param.get_usage_pieces(ctx))
                continue
            name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
            pieces.append(name if param.required else f"[{name}]")
        return pieces


app = typer.Typer(
    name="ckptkit",
    rich_markup_mode=None,  # plain click help: fits 80 columns, never cuts an option name
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
Format = StrEnum("Format", {name.replace("-", "_"): name for name in format_names()})  # type: ignore[misc]
ModelType = StrEnum("ModelType", {name: name for name in MODEL_TYPES})  # type: ignore[misc]


NO_COPY = "off"
# auto, direct, stream, off: the fallbacks auto picks by itself (gather, copy_file_range...)
# are not for users to choose; --verbose shows which were used
CopyMethod = StrEnum("CopyMethod", {m: m for m in (*COPY_METHODS, NO_COPY)})  # type: ignore[misc]


_FORMATS = ", ".join(format_names())
MODEL_TYPE_HELP = f"Model type (default: detected from the files): {', '.join(MODEL_TYPES)}."


class DType(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    q8_0 = "q8_0"


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


CONFIG_HELP = "Model config (params.json or config.json) for a source without one, such as a DCP folder."


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@app.command(cls=Command)
@user_errors
def inspect(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="Checkpoint directory or one weight / index file.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model_type: Annotated[ModelType | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help=CONFIG_HELP)] = None,
) -> None:
    """List format, model type, dtypes and tensors; reads metadata only."""
    from ckptkit.inspection import inspect_path

    info = inspect_path(path, model_type.value if model_type else None, config)
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
    if info.get("ignored"):
        out.print(f"not model   {len(info['ignored'])} entries, not converted: {', '.join(info['ignored'][:6])}")
    table = Table(box=None, header_style="bold")
    table.add_column("name", overflow="fold")
    for column in ("shape", "dtype", "file"):
        table.add_column(column, no_wrap=True)
    if not out.is_terminal:  # piped: full names on one line each, for grep and friends
        out.width = 1000
    for t in info["tensors"]:
        table.add_row(t["name"], "[" + ", ".join(map(str, t["shape"])) + "]", t["dtype"], t["file"])
    out.print(table)


@app.command(cls=Command)
@user_errors
def convert(
    src: Annotated[Path, typer.Argument(metavar="SRC", help="Source checkpoint directory (never modified).")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Destination directory (must not exist or be empty).")],
    to: Annotated[Format, typer.Option("--to", metavar="FORMAT", help=f"Target format: {_FORMATS}.")],
    from_: Annotated[
        Format | None, typer.Option("--from", metavar="FORMAT", help="Source format (default: detected).")
    ] = None,
    model_type: Annotated[ModelType | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
    dtype: Annotated[
        DType | None,
        typer.Option(
            metavar="DTYPE",
            help=f"Cast floating tensors to {', '.join(DType)} (default: keep every dtype and byte).",
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
        typer.Option(
            "--allow-lossy-cast", help="Let --dtype overflow values to inf or flush them to 0 (an error otherwise)."
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or summary.")] = False,
    force_model_type: Annotated[
        bool,
        typer.Option("--force-model-type", help="Use --model-type even where the files describe another type."),
    ] = False,
    copy_method: Annotated[
        CopyMethod,
        typer.Option(
            metavar="METHOD",
            help=f"How tensors go file to file: {', '.join(CopyMethod)} (auto: direct past the page cache "
            "for outputs over the kernel's dirty limit, else stream through it; off: through memory).",
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
            config=config,
            force_model_type=force_model_type,
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
    from ckptkit.tensors.casting import cast_description

    return cast_description(dtype) if dtype else "verified bitwise against the source"


@app.command(cls=Command)
@user_errors
def verify(
    a: Annotated[Path, typer.Argument(metavar="A", help="First checkpoint (any format).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Second checkpoint (any format).")],
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
) -> None:
    """Compare two checkpoints tensor by tensor, bitwise, in each one's own names.

    The first line is the verdict. Exit status: 0 identical (or only casts, with
    --allow-cast); 3 the only differences are dtype casts; 1 anything else differs or is
    missing (or an input error).
    """
    from ckptkit.verify import verify_paths

    report = verify_paths(a, b, quiet=json_out)
    if logits:  # both through the native decoder
        from ckptkit.train.logit_check import compare_logits

        report.logits = compare_logits(a, b, report.model_type)
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


# --- recipes: run, ls, cp --------------------------------------------------------------


@app.command(cls=Command, context_settings={"allow_extra_args": False})
@user_errors
def run(
    recipe: Annotated[
        str, typer.Argument(metavar="RECIPE", help="Bundled recipe (see `ckptkit ls`) or a recipe .py file.")
    ],
    config: Annotated[str, typer.Option("--config", metavar="CONFIG", help="Bundled config name or a YAML path.")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(metavar="KEY=VALUE", help="Config overrides, e.g. optimizer.lr=3e-4", show_default=False),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node", metavar="N", min=1, help="Start N processes with torchrun (distributed recipes)."
        ),
    ] = None,
) -> None:
    """Run a training recipe with a config and KEY=VALUE overrides."""
    from ckptkit.train.config import load_config, resolve_config
    from ckptkit.train.recipes import launch_torchrun, recipe_entry

    entry = recipe_entry(recipe)
    cfg = load_config(config, overrides or [])
    try:
        if nproc_per_node is None:
            entry(cfg)
        else:
            launch_torchrun(recipe, nproc_per_node, config, overrides or [], cfg)
    except CkptkitError as e:  # "config key x: ...": say which file (and that overrides count)
        if not str(e).startswith("config"):
            raise
        given = " with the KEY=VALUE overrides" if overrides else ""
        raise CkptkitError(f"{resolve_config(config)}{given}: {e}") from None


@app.command(cls=Command, name="ls")
@user_errors
def list_recipes() -> None:
    """List the bundled recipes and their configs."""
    from ckptkit.train.recipes import RECIPES

    table = Table("recipe", "configs", box=None, header_style="bold")
    for name, configs in RECIPES.items():
        table.add_row(name, ", ".join(configs))
    out.print(table)


@app.command(cls=Command)
@user_errors
def cp(
    name: Annotated[str, typer.Argument(metavar="NAME", help="A bundled recipe or config name (see `ckptkit ls`).")],
    dest: Annotated[Path, typer.Argument(metavar="DEST", help="File or directory to copy it to.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Copy a bundled recipe (.py) or config (.yaml) out for editing."""
    import shutil

    from ckptkit.train.config import bundled_configs
    from ckptkit.train.recipes import RECIPE_DIR, RECIPES, recipe_script

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
    if name in RECIPES:  # one script holding the training loop, to edit
        target.write_text(recipe_script(name), encoding="utf-8")
    else:
        shutil.copyfile(src, target)
    err.print(f"copied {name} to {target}", highlight=False)


# --- generate (native model; body in ckptkit/train/generation.py) -------------------------------


@app.command(cls=Command)
@user_errors
def generate(
    checkpoint: Annotated[
        Path, typer.Argument(metavar="CHECKPOINT", help="Checkpoint directory (any format) with a tokenizer.")
    ],
    prompt: Annotated[str, typer.Option("--prompt", metavar="TEXT", help="Text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(metavar="T", min=0.0, help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(metavar="K", min=1, help="Sample from the K most likely tokens.")] = None,
    adapter: Annotated[Path | None, typer.Option(metavar="DIR", help="PEFT LoRA adapter directory to apply.")] = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Random seed for sampling.")] = 0,
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


@app.command(cls=Command)
@user_errors
def merge(
    base: Annotated[
        Path, typer.Argument(metavar="BASE", help="The base checkpoint the adapter was trained on (any format).")
    ],
    adapter: Annotated[
        Path, typer.Argument(metavar="ADAPTER", help="PEFT LoRA adapter directory, e.g. out/epoch_0/adapter.")
    ],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Destination directory (must not exist or be empty).")],
    model_type: Annotated[ModelType | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
) -> None:
    """Fold a LoRA adapter into its base: DST has the base's format, files and shards, merged weights."""
    from ckptkit.train.export import merge_adapter_into_checkpoint

    merge_adapter_into_checkpoint(base, adapter, dst, model_type.value if model_type else None)
    err.print(f"wrote {dst} (the merged model)", highlight=False)
