"""The commands around training: ``run``, ``ls``, ``cp``, ``generate``, ``merge``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ckptkit.cli.app import MODEL_TYPE_HELP, NOTHING_WRITTEN, Command, app, err, out, user_errors
from ckptkit.errors import CkptkitError, ConfigError

# --- recipes: run, ls, cp --------------------------------------------------------------


@app.command(cls=Command, context_settings={"allow_extra_args": False})
@user_errors(stopped="no checkpoint was left half-written")
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
    except ConfigError as e:  # "config key x: ...": say which file (and that overrides count)
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
@user_errors(stopped=NOTHING_WRITTEN)
def merge(
    base: Annotated[
        Path,
        typer.Argument(
            metavar="BASE", help="The base checkpoint the adapter was trained on (any format; or a Hub repository)."
        ),
    ],
    adapter: Annotated[
        Path, typer.Argument(metavar="ADAPTER", help="PEFT LoRA adapter directory, e.g. out/epoch_0/adapter.")
    ],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Destination directory (must not exist or be empty).")],
    model_type: Annotated[str | None, typer.Option(metavar="TYPE", help=MODEL_TYPE_HELP)] = None,
) -> None:
    """Fold a LoRA adapter into its base: DST has the base's format, files and shards, merged weights."""
    from ckptkit.hub import hub_source, parse_ref
    from ckptkit.train.export import merge_adapter_into_checkpoint

    if parse_ref(base) is not None:  # a Hub base: the adapter and DST refused before a byte of it is fetched
        from ckptkit.convert import check_replaceable
        from ckptkit.formats.peft_adapter import read_adapter_config

        read_adapter_config(adapter)
        check_replaceable(dst, False)
    with hub_source(base, model_type=model_type) as got:
        merge_adapter_into_checkpoint(got.path, adapter, dst, model_type)
    err.print(f"wrote {dst} (the merged model)", highlight=False)
