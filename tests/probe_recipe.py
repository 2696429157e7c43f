"""Run a bundled recipe and record, per rank, what the training loop built and did, taken from
the objects themselves (not from what the recipe logs), in ``OUTPUT_DIR/probe_rank_N.json``:

- ``compiled``: per decoder block, whether it runs as a compiled module (``Module.compile``);
- ``param_groups``: the optimizer's own initial lr, betas, weight decay and fused flag;
- ``training`` / ``validation``: the token ids of every sample of each set;
- ``steps``: per optimizer step, the learning rate it used, the sample indices of each of its
  global batches, this rank's part of each, and the gradient norm clipping saw with its max norm.

    python tests/probe_recipe.py RECIPE --config CONFIG [key=value ...]
    torchrun --nproc-per-node 2 tests/probe_recipe.py RECIPE_distributed --config ...

or in a test's process: ``with probing(): recipe_main(cfg)``.
"""

from __future__ import annotations

import contextlib
import json
import runpy
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ckptkit.train.loop import Recipe
from ckptkit.train.lora import decoder_layers


@contextlib.contextmanager
def probing() -> Iterator[dict[str, Any]]:
    """While in the block, every recipe run records into the dict it yields (a fresh one) and
    writes it at its cleanup; the loop's methods and ``clip_grad_norm_`` are restored after."""
    record: dict[str, Any] = {"steps": []}
    setup, step, cleanup, clip = Recipe.setup, Recipe._step, Recipe.cleanup, torch.nn.utils.clip_grad_norm_

    def probed_setup(self: Recipe) -> None:
        setup(self)
        record["compiled"] = [getattr(b, "_compiled_call_impl", None) is not None for b in decoder_layers(self.model)]
        keys = ("initial_lr", "betas", "weight_decay", "fused")
        record["param_groups"] = [{k: group[k] for k in keys} for group in self.optimizer.param_groups]
        record["training"] = [s.ids for s in self.dataset.samples]
        record["validation"] = None if self.val_dataset is None else [s.ids for s in self.val_dataset.samples]

    def probed_step(self: Recipe, batches: list[list[int]]) -> tuple[float, int]:
        mine = [self.placement.mine(b) for b in batches]
        lr = self.optimizer.param_groups[0]["lr"]
        record["steps"].append({"lr": lr, "batches": batches, "mine": mine, "clip": None})
        return step(self, batches)

    def probed_clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = clip(parameters, max_norm, *args, **kwargs)
        whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        record["steps"][-1]["clip"] = [float(whole), max_norm]
        return norm

    def probed_cleanup(self: Recipe) -> None:
        cleanup(self)
        path = self.checkpointer.output_dir / f"probe_rank_{self.placement.rank}.json"
        path.write_text(json.dumps(record))

    Recipe.setup, Recipe._step, Recipe.cleanup = probed_setup, probed_step, probed_cleanup  # type: ignore[method-assign]
    torch.nn.utils.clip_grad_norm_ = probed_clip  # type: ignore[assignment]
    try:
        yield record
    finally:
        Recipe.setup, Recipe._step, Recipe.cleanup = setup, step, cleanup  # type: ignore[method-assign]
        torch.nn.utils.clip_grad_norm_ = clip


if __name__ == "__main__":
    with probing():
        recipe = sys.argv.pop(1)
        runpy.run_module(f"ckptkit.train.recipes.{recipe}", run_name="__main__", alter_sys=True)
