"""The ``ckptkit`` application: the Typer app every command registers on, its choice
options (read from the registries when a command runs, so a format registered by a
plugin is offered too) and the one-line error reporting every command shares."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from typer._click._textwrap import TextWrapper as HelpWrapper
from typer._click.exceptions import UsageError
from typer.core import TyperCommand, TyperGroup

from ckptkit import __version__
from ckptkit.errors import CkptkitError, FlagError
from ckptkit.formats import REGISTRY as FORMATS
from ckptkit.formats import format_names, load_plugins
from ckptkit.formats.gguf.mix import quantize_type
from ckptkit.io import AUTO, COPY_METHODS, signal_of, stopping_on_signals
from ckptkit.models import EXPERTS_LAYOUTS, model_types
from ckptkit.progress import human  # noqa: F401  (the commands import it from here)
from ckptkit.tensors.dtypes import CAST_TARGETS, DTYPE_ALIASES

NO_COPY = "off"
# Help wraps at spaces only: never inside a choice or a flag at its hyphen (``hf-`` / ``bin``).
HelpWrapper.wordsep_re = textwrap.TextWrapper.wordsep_simple_re


def dtype_choices() -> list[str]:
    """``--dtype``: the casts every format takes, then those only some formats take."""
    extra = [d for f in FORMATS.values() for d in f.info.extra_dtypes if d not in CAST_TARGETS]
    return [*CAST_TARGETS, *dict.fromkeys(extra)]


def copy_method_choices() -> list[str]:
    """auto, direct, stream, off: the fallbacks auto picks by itself (gather,
    copy_file_range...) are not for users to choose; --verbose shows which were used."""
    return [*COPY_METHODS, NO_COPY]


# Options whose value is one of a list, by parameter name: the list is asked for when a
# command parses or prints its help, never frozen at import.
CHOICES: dict[str, Callable[[], list[str]]] = {
    "to": lambda: list(format_names()),
    "from_": lambda: list(format_names()),
    "model_type": model_types,
    "dtype": dtype_choices,
    "copy_method": copy_method_choices,
    "experts": lambda: list(EXPERTS_LAYOUTS),
}
CHOICES_MARK = "{choices}"  # in an option's help: replaced by its choices


def aliases() -> dict[str, str]:
    """What users type for a choice (``huggingface``, ``bf16``) and the choice they mean."""
    found = {alias: f.name for f in FORMATS.values() for alias in f.info.aliases}
    return found | DTYPE_ALIASES


class OneLineUsageError(UsageError):
    """Bad usage told in one line (exit 2), without the usage preamble."""

    def show(self, file: Any = None) -> None:
        sys.stderr.write(f"error: {self.format_message()}\n")


def _suggestion(value: str, choices: list[str]) -> str | None:
    meant = aliases().get(value.lower())
    if meant in choices:
        return meant
    close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.4)
    close = close or [c for c in choices if c.startswith(value.lower()[:2])]
    return close[0] if close else None


def check_choices(params: list[Any], args: list[str]) -> None:
    """An unknown value of a choice option, refused in one line that lists the valid ones
    and the closest (``--to huggingface``: did you mean 'hf'?)."""
    for param in params:
        provider = CHOICES.get(param.name or "") if param.param_type_name == "option" else None
        if provider is None:
            continue
        choices = provider()
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag not in param.opts:
                continue
            if not eq:
                if i + 1 >= len(args):
                    break
                value = args[i + 1]
            if value in choices or (param.name == "dtype" and value.lower() in map(str.lower, choices)):
                continue
            if param.name == "dtype":
                try:
                    quantize_type(value)  # llama-quantize's types not written yet: one line saying so
                except CkptkitError as e:
                    raise OneLineUsageError(str(e)) from None
            close = _suggestion(value, choices)
            hint = f"; did you mean {close!r}?" if close else ""
            raise OneLineUsageError(f"{flag} {value}: not one of {', '.join(choices)}{hint}")


@contextlib.contextmanager
def one_line_usage(ctx: Any) -> Iterator[None]:
    """Click's usage errors (unknown or missing option, bad value) as one line, exit 2,
    naming the help to read instead of printing the usage block."""
    try:
        yield
    except OneLineUsageError:
        raise
    except UsageError as e:
        message = " ".join(e.format_message().split()).rstrip(".")
        raise OneLineUsageError(f"{message}; see `{ctx.command_path} -h`") from None


class Group(TyperGroup):
    """The ``ckptkit`` group: an unknown command is one line too."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with one_line_usage(ctx):
            return super().parse_args(ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        with one_line_usage(ctx):
            return super().resolve_command(ctx, args)


class Command(TyperCommand):
    """A command whose usage line names its arguments as the docs do (``SRC DST``), whose
    choice options list the registries' current values, and whose unknown choices get
    one line with a did-you-mean."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        for problem in load_plugins():
            err.print(f"warning: {problem}; fix or uninstall that package", highlight=False, markup=False)
        with one_line_usage(ctx):
            if "-h" not in args and "--help" not in args:
                check_choices(self.get_params(ctx), args)
            return super().parse_args(ctx, args)

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            template = getattr(param, "help_template", None) or getattr(param, "help", None)
            provider = CHOICES.get(param.name or "")
            if provider and template and CHOICES_MARK in template:
                param.help_template = template  # type: ignore[attr-defined]
                param.help = template.replace(CHOICES_MARK, ", ".join(provider()))  # type: ignore[attr-defined]
        return params

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
    cls=Group,
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

MODEL_TYPE_HELP = f"Model type (default: detected from the files): {CHOICES_MARK}."
CONFIG_HELP = "Model config (params.json or config.json) for a source without one, such as a DCP folder."
DEFAULT_COPY_METHOD = AUTO
NOTHING_WRITTEN = "nothing was written to the destination"  # after a stop, for commands that write one


def user_errors(fn: F | None = None, *, stopped: str | None = None) -> Any:
    """Turn CkptkitError (and I/O failures) into one line on stderr and exit 1 (2 for a
    FlagError: bad usage); a stop
    (Ctrl-C, SIGTERM, SIGHUP: see :func:`~ckptkit.io.publish.stopping_on_signals`) into
    one line (ending in ``stopped``: what is true of the outputs then) and exit 128 + the
    signal's number (130, 143, 129)."""
    if fn is None:
        return functools.partial(user_errors, stopped=stopped)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with stopping_on_signals():
                return fn(*args, **kwargs)
        except CkptkitError as e:
            err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(2 if isinstance(e, FlagError) else 1) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            err.print(f"[red]error:[/red] {where}{e.strerror or e}", markup=True, highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt as e:
            err.print(stop_line(e, stopped), highlight=False, markup=False)
            raise typer.Exit(128 + signal_of(e)) from None

    return wrapper


def stop_line(stop: KeyboardInterrupt, then: str | None = None) -> str:
    """``interrupted; THEN`` for Ctrl-C, ``stopped by SIGTERM; THEN`` for a signal."""
    signum = signal_of(stop)
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return f"{how}; {then}" if then else how


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


@contextlib.contextmanager
def logging_to_stderr(name: str, level: int | None) -> Iterator[None]:
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
