"""Bundled recipes and the configs written for each."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, FlagError
from ckptkit.io import Stopped

if TYPE_CHECKING:
    from ckptkit.train.placement import Placement
    from ckptkit.train.schema import RecipeConfig

RECIPE_DIR = Path(__file__).parent
RECIPES: dict[str, list[str]] = {
    "full_finetune": ["tiny_full", "llama2_7B_full", "llama3_1_8B_full", "olmo2_7B_full"],
    "lora_finetune": [
        "tiny_lora",
        "llama2_7B_lora",
        "llama3_1_8B_lora",
        "mistral_7B_lora",
        "qwen2_1_5B_lora",
        "qwen3_8B_lora",
        "qwen3_30B_A3B_lora",
        "mixtral_8x7B_lora",
        "gemma2_9B_lora",
        "qwen3_5_35B_A3B_lora",
        "gpt_oss_20B_lora",
        "qwen3_5_27B_qlora",
    ],
    "full_finetune_distributed": [
        "tiny_full_distributed",
        "llama2_7B_full_distributed",
        "llama3_1_8B_full_distributed",
    ],
    "lora_finetune_distributed": [
        "tiny_lora_distributed",
        "llama2_7B_lora_distributed",
        "llama3_1_8B_lora_distributed",
        "mixtral_8x7B_lora_distributed",
        "moonlight_16B_A3B_lora_distributed",
        "glm4_5_air_lora_distributed",
    ],
}


# torchrun's agent loggers that tell of the shutdown a stop signal starts
TORCHRUN_STOP_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")

_SCRIPT_TAIL = """

# --- this file as a script ------------------------------------------------------------------
RECIPE = "{recipe}"
\"\"\"The entry of ``RECIPES`` (schema, trainable, placement) this script runs.\"\"\"


def recipe_main(cfg: dict[str, Any]) -> None:
    \"\"\"``ckptkit run THIS_FILE --config CONFIG``: the loop above as recipe ``RECIPE``.\"\"\"
    run(cfg, RECIPE)


if __name__ == "__main__":
    main(RECIPE, __doc__ or RECIPE)
"""


def recipe_script(name: str) -> str:
    """Bundled recipe ``name`` as one editable script (what ``ckptkit cp NAME`` writes): the
    training loop's own source (:mod:`ckptkit.train.loop`) under the recipe's description,
    set to run as ``name``, with a ``recipe_main`` and a ``__main__`` of its own."""
    from ckptkit.train import loop

    source = Path(loop.__file__).read_text(encoding="utf-8")
    body = source.splitlines(keepends=True)[ast.parse(source).body[0].end_lineno or 0 :]
    recipe_doc = importlib.import_module(f"ckptkit.train.recipes.{name}").__doc__ or name
    header = (
        f"{recipe_doc.strip()}\n\n"
        f"This file is ckptkit's training loop, written by ``ckptkit cp {name}`` for you to change\n"
        "(the building blocks it imports stay ckptkit's). Run it with\n"
        f"``ckptkit run ./{name}.py --config CONFIG [key=value ...]`` (add ``--nproc-per-node N``\n"
        f"for a distributed recipe) or ``python {name}.py --config CONFIG [key=value ...]``.\n\n"
        f"{(loop.__doc__ or '').strip()}\n"
    )
    return f'"""{header}"""\n' + "".join(body).rstrip("\n") + "\n" + _SCRIPT_TAIL.format(recipe=name)


@functools.cache
def _recipe_file(path: Path, mtime_ns: int) -> ModuleType:
    """A recipe file (e.g. one written by ``ckptkit cp``) loaded as a module, once per version."""
    spec = importlib.util.spec_from_file_location(f"ckptkit_user_recipe_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module(name_or_path: str) -> ModuleType:
    if name_or_path in RECIPES:
        return importlib.import_module(f"ckptkit.train.recipes.{name_or_path}")
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return _recipe_file(path.resolve(), path.stat().st_mtime_ns)
    raise CkptkitError(f"{name_or_path}: no such recipe (bundled: {', '.join(RECIPES)}) or recipe file")


def recipe_entry(name_or_path: str) -> Callable[[dict[str, Any]], None]:
    """``recipe_main`` of a bundled recipe, or of a recipe file (e.g. one copied with ``ckptkit cp``)."""
    entry = getattr(_module(name_or_path), "recipe_main", None)
    if entry is None:
        raise CkptkitError(f"{name_or_path}: has no recipe_main(cfg) function")
    return entry


def _recipe_spec(name_or_path: str) -> tuple[type[RecipeConfig], Any, type[Placement]] | None:
    """(schema, trainable, placement) of a bundled recipe or of a script written by ``ckptkit cp``
    (None: a recipe file of another shape)."""
    if name_or_path in RECIPES:
        from ckptkit.train.loop import RECIPES as SPECS

        return SPECS[name_or_path]
    module = _module(name_or_path)
    specs, name = getattr(module, "RECIPES", None), getattr(module, "RECIPE", None)
    return specs[name] if isinstance(specs, dict) and name in specs else None


def launch_torchrun(recipe: str, nproc_per_node: int, config: str, overrides: list[str], cfg: dict[str, Any]) -> None:
    """Start ``nproc_per_node`` processes of a distributed recipe on this node, as
    ``torchrun --standalone --nproc-per-node N -m ckptkit.train.recipes.RECIPE`` does.

    The config (``cfg``, already parsed) and its base checkpoint are checked first, so the
    usual mistakes are one line here rather than one per process."""
    spec = _recipe_spec(recipe)
    if spec is not None:
        schema, _, placement = spec
        if not placement.launched_by_torchrun and recipe in RECIPES:
            raise FlagError(f"{recipe} runs on one device; use {recipe}_distributed with --nproc-per-node")
        if not placement.launched_by_torchrun:
            raise FlagError(f"{recipe}: runs on one device; run it without --nproc-per-node")
        from ckptkit.train.checkpointer import Checkpointer
        from ckptkit.train.config import parse_config

        checked = parse_config(cfg, schema)  # torchtune spellings, defaults, one-line errors
        checkpointer = Checkpointer(checked.checkpointer, checked.resume_from_checkpoint)
        checkpointer.open_base().close()
        checkpointer.check_fresh()  # a folder holding another run: one line here, before any process starts
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    target = ["-m", f"ckptkit.train.recipes.{recipe}"] if recipe in RECIPES else [recipe]
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc_per_node}", *target, "--config", config, *overrides]
    )
    quiet = {name: logging.getLogger(name) for name in TORCHRUN_STOP_LOGGERS}
    levels = {name: logger.level for name, logger in quiet.items()}
    try:
        for logger in quiet.values():  # "Received 15 death signal", "Sending process N closing signal"
            logger.setLevel(logging.ERROR)
        torchrun(args)
    except SignalException as e:  # every rank was sent it and has stopped: rank 0 said where it got to
        raise Stopped(e.sigval) from None
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        raise CkptkitError(
            f"{recipe}: {len(e.failures)} of {nproc_per_node} processes failed (exit code {', '.join(map(str, codes))})"
        ) from None
    finally:
        for name, logger in quiet.items():
            logger.setLevel(levels[name])
