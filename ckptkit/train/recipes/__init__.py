"""Bundled recipes and the configs written for each."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError

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
    ],
}


def recipe_entry(name_or_path: str) -> Callable[[dict[str, Any]], None]:
    """``recipe_main`` of a bundled recipe, or of a recipe file (e.g. one copied with ``ckptkit cp``)."""
    if name_or_path in RECIPES:
        return importlib.import_module(f"ckptkit.train.recipes.{name_or_path}").recipe_main
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        spec = importlib.util.spec_from_file_location(f"ckptkit_user_recipe_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        entry = getattr(module, "recipe_main", None)
        if entry is None:
            raise CkptkitError(f"{path}: has no recipe_main(cfg) function")
        return entry
    raise CkptkitError(f"{name_or_path}: no such recipe (bundled: {', '.join(RECIPES)}) or recipe file")


def launch_torchrun(recipe: str, nproc_per_node: int, config: str, overrides: list[str], cfg: dict[str, Any]) -> None:
    """Start ``nproc_per_node`` processes of a distributed recipe on this node, as
    ``torchrun --standalone --nproc-per-node N -m ckptkit.train.recipes.RECIPE`` does.

    The config (``cfg``, already parsed) and its base checkpoint are checked first, so the
    usual mistakes are one line here rather than one per process."""
    if recipe in RECIPES and not recipe.endswith("_distributed"):
        raise CkptkitError(f"{recipe} runs on one device; use {recipe}_distributed with --nproc-per-node")
    from ckptkit.train.checkpointer import Checkpointer

    checked: Any = cfg  # a recipe file's config: its checkpointer section is checked
    if recipe in RECIPES:  # the recipe's own schema: torchtune spellings, defaults, one-line errors
        from ckptkit.train.config import parse_config
        from ckptkit.train.loop import RECIPES as SPECS

        checked = parse_config(cfg, SPECS[recipe][0])
    Checkpointer(checked).open_base().close()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    target = ["-m", f"ckptkit.train.recipes.{recipe}"] if recipe in RECIPES else [recipe]
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc_per_node}", *target, "--config", config, *overrides]
    )
    try:
        torchrun(args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        raise CkptkitError(
            f"{recipe}: {len(e.failures)} of {nproc_per_node} processes failed (exit code {', '.join(map(str, codes))})"
        ) from None
