"""Full fine-tuning on one device (CPU or CUDA).

Run it as ``ckptkit run full_finetune --config CONFIG [key=value ...]`` or as
``python full_finetune.py --config CONFIG [key=value ...]`` after ``ckptkit cp``.

The recipe reads any checkpoint ckptkit reads and writes its checkpoints in the same
format, file names and shard partition. Resuming restores weights, optimizer, schedule,
RNG and data position, so a resumed run ends bitwise where an uninterrupted one does.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ckptkit.dtypes import dtype_name
from ckptkit.errors import CkptkitError
from ckptkit.train.checkpointer import Checkpointer, checkpoint_name, rng_state, set_rng_state
from ckptkit.train.config import get, load_config, validate_config
from ckptkit.train.data import build_datasets, collate, epoch_batches
from ckptkit.train.metrics import MetricLogger, Progress
from ckptkit.train.schema import FullFinetuneConfig
from ckptkit.train.step import build_optimizer, compile_layers, evaluate, forward_backward
from ckptkit.train.tokenizer import load_tokenizer
from ckptkit.train.transformer import build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FullFinetuneRecipe:
    """Updates every weight of the model with AdamW, warmup + cosine schedule."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.seed = int(get(cfg, "seed", 0))
        device = get(cfg, "device", "cpu")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise CkptkitError("device is cuda but no CUDA device is available; set device=cpu")
        self.device = torch.device(device)
        dtype = get(cfg, "dtype", "fp32")
        if dtype not in DTYPES:
            raise CkptkitError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.epochs = int(get(cfg, "epochs", 1))
        self.max_steps_per_epoch = get(cfg, "max_steps_per_epoch")
        self.batch_size = int(get(cfg, "batch_size", 4))
        self.grad_accum = int(get(cfg, "gradient_accumulation_steps", 1))
        self.clip = get(cfg, "clip_grad_norm")
        self.log_every = int(get(cfg, "log_every_n_steps", 1))
        self.save_every = get(cfg, "save_every_n_steps")
        self.eval_every = get(cfg, "eval_every_n_steps")
        self.checkpointer = Checkpointer(cfg)
        self.output_dir = self.checkpointer.output_dir
        self.quiet = bool(get(cfg, "quiet", False))
        torch.manual_seed(self.seed)
        random.seed(self.seed)

    def setup(self) -> None:
        """Load the checkpoint (and recipe state when resuming), build model, data, optimizer."""
        state = self.checkpointer.load_recipe_state()
        if state is not None:
            self.checkpointer.check_state(state, self.seed, self.epochs, self.max_steps_per_epoch)
        model_cfg = self.checkpointer.model_config()  # format, layout and config checks: no weights read yet
        model_cfg, weights = self.checkpointer.load_base()
        if state is not None:  # the weights saved with that state, at full precision if the format rounds them
            weights = state["model"] if "model" in state else self.checkpointer.load_resume_weights()
        self.model = build_model(model_cfg, device="meta", dtype=self.dtype)
        self.model.load_state_dict({k: v.to(self.dtype) for k, v in weights.items()}, assign=True)
        self.model.to(self.device).train()
        if get(self.cfg, "enable_activation_checkpointing", False):
            for layer in self.model.layers:
                layer.forward = lambda *a, f=layer.forward: checkpoint(f, *a, use_reentrant=False)
        if get(self.cfg, "compile", False):
            compile_layers(self.model)

        tokenizer_dir = get(self.cfg, "tokenizer") or self.checkpointer.checkpoint_dir
        self.tokenizer = load_tokenizer(tokenizer_dir, model_cfg.eos_token_id)
        folder = Path(tokenizer_dir) if Path(tokenizer_dir).is_dir() else Path(tokenizer_dir).parent
        self.dataset, self.val_dataset = build_datasets(get(self.cfg, "dataset", {}), self.tokenizer, folder, self.seed)
        self.pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
        batches = len(self.dataset) // self.batch_size // self.grad_accum
        if batches == 0:
            raise CkptkitError(
                f"dataset has {len(self.dataset)} samples, fewer than batch_size x gradient_accumulation_steps"
            )
        self.steps_per_epoch = min(batches, self.max_steps_per_epoch or batches)

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trainable, get(self.cfg, "optimizer", {}), self.device)
        sched = get(self.cfg, "lr_scheduler", {})
        warmup, floor = int(sched.get("warmup_steps", 0)), float(sched.get("min_lr_ratio", 0.0))
        total = self.epochs * self.steps_per_epoch

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = (step - warmup) / max(1, total - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

        self.epochs_run, self.global_step, self.steps_in_epoch = 0, 0, 0
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["lr_scheduler"])
            self.epochs_run, self.global_step = state["epochs_run"], state["global_step"]
            self.steps_in_epoch = state["steps_in_epoch"]
            set_rng_state(state["rng"])
        self.metrics = MetricLogger(self.output_dir, state is not None, get(self.cfg, "wandb"), self.cfg)

    def train(self) -> None:
        """Epochs of optimizer steps; checkpoints at epoch ends and every save_every_n_steps."""
        total_steps = self.epochs * self.steps_per_epoch
        self.progress = Progress(total_steps, self.global_step, self.quiet, self.log_every, str(self.device))
        with self.progress as progress:
            for epoch in range(self.epochs_run, self.epochs):
                batches = epoch_batches(len(self.dataset), self.batch_size, self.seed, epoch)
                while self.steps_in_epoch < self.steps_per_epoch:
                    start = time.perf_counter()
                    step_batches = batches[self.steps_in_epoch * self.grad_accum :][: self.grad_accum]
                    loss, tokens = self._step(step_batches)
                    self.steps_in_epoch += 1
                    self.global_step += 1
                    rate = tokens / (time.perf_counter() - start)
                    progress.update(self.global_step, epoch, loss, self.scheduler.get_last_lr()[0], rate, tokens)
                    if self.global_step % self.log_every == 0:
                        self.metrics.log(
                            step=self.global_step, epoch=epoch, loss=loss,
                            lr=self.scheduler.get_last_lr()[0], tokens_per_second=rate,
                        )  # fmt: skip
                    if self.eval_every and self.global_step % int(self.eval_every) == 0:
                        self._evaluate(epoch)
                    due = self.save_every and self.global_step % int(self.save_every) == 0
                    if due and self.steps_in_epoch < self.steps_per_epoch:  # an epoch's end saves epoch_N
                        self._save(checkpoint_name("step", self.global_step, total_steps), epoch, final=False)
                self.epochs_run, self.steps_in_epoch = epoch + 1, 0
                if not self.eval_every or self.global_step % int(self.eval_every):
                    self._evaluate(epoch)
                name = checkpoint_name("epoch", epoch, self.epochs - 1)
                self._save(name, epoch + 1, final=self.epochs_run == self.epochs)
        self.finished = True

    def _step(self, step_batches: list[list[int]]) -> tuple[float, int]:
        """One optimizer step over gradient_accumulation_steps batches, every label token weighted
        equally; (mean loss per label token, input tokens)."""
        stats = forward_backward(
            self.model, [collate([self.dataset[i] for i in b], self.pad_id) for b in step_batches], self.device
        )
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats.loss, stats.input_tokens

    def _evaluate(self, epoch: int) -> None:
        """Mean loss per label token on the validation set, when there is one."""
        if self.val_dataset is not None:
            loss = evaluate(self.model, self.val_dataset, self.batch_size, self.pad_id, self.device)
            self.metrics.log(step=self.global_step, epoch=epoch, eval_loss=loss)

    def _save(self, name: str, epochs_run: int, final: bool) -> None:
        weights = {k: v.detach() for k, v in self.model.state_dict().items()}
        state = None
        if not final:
            state = {
                "seed": self.seed,
                "epochs_run": epochs_run,
                "total_epochs": self.epochs,
                "max_steps_per_epoch": self.max_steps_per_epoch,
                "global_step": self.global_step,
                "steps_in_epoch": self.steps_in_epoch,
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
            }
            if any(self.checkpointer.dtypes[k] != dtype_name(v.dtype) for k, v in weights.items()):
                state["model"] = {k: v.cpu() for k, v in weights.items()}  # the checkpoint's dtype rounds them
        path = self.checkpointer.save(name, weights, recipe_state=state)
        self.metrics.event(checkpoint=str(path), step=self.global_step)
        self.progress.note(f"saved {path}")
        for gone in self.checkpointer.prune(self.steps_per_epoch):
            self.progress.note(f"deleted {gone} (checkpointer.keep_last_n_checkpoints)")

    def cleanup(self) -> None:
        self.metrics.close()
        if hasattr(self, "progress"):  # what was reached, the checkpoints, how to resume a stopped run
            self.progress.summary(self.global_step, self.checkpointer, getattr(self, "finished", False))


def recipe_main(cfg: dict[str, Any]) -> None:
    cfg = validate_config(cfg, FullFinetuneConfig)  # before any work: one line per bad key, nothing written
    recipe = FullFinetuneRecipe(cfg)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args()
    try:
        recipe_main(load_config(args.config, overrides))
    except CkptkitError as e:
        sys.exit(f"error: {e}")
