"""Full fine-tuning on several devices or nodes: FSDP2 launched by torchrun.

Run it as ``ckptkit run --nproc-per-node N full_finetune_distributed --config CONFIG [key=value ...]``
or as ``torchrun --nproc-per-node N -m ckptkit.train.recipes.full_finetune_distributed --config ...``.

Every decoder layer and the root are sharded with ``fully_shard``; ``batch_size`` is per
rank, so N ranks with ``batch_size`` b take the same global batches, in the same seeded
order, as ``full_finetune`` with ``batch_size`` N x b, and give the same losses. Checkpoints
are written in the input's format, file names and shard partition, gathered one tensor at
a time; ``recipe_state/`` (DCP) holds the sharded optimizer state, schedule, RNG per rank
and data position. Resuming at the same world size is bitwise exact; at another world
size (same global batch) DCP reshards the optimizer state.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ckptkit.checkpoint import open_checkpoint
from ckptkit.dtypes import dtype_name
from ckptkit.errors import CkptkitError
from ckptkit.train import distributed as D
from ckptkit.train.checkpointer import Checkpointer, checkpoint_name, rng_state, set_rng_state
from ckptkit.train.config import get, load_config, validate_config
from ckptkit.train.data import IGNORE_INDEX, build_dataset, collate, epoch_batches
from ckptkit.train.metrics import MetricLogger, Progress
from ckptkit.train.schema import FullFinetuneDistributedConfig
from ckptkit.train.step import model_inputs
from ckptkit.train.tokenizer import load_tokenizer
from ckptkit.train.transformer import build_model


class FullFinetuneDistributedRecipe:
    """Updates every weight of the FSDP2-sharded model with AdamW, warmup + cosine schedule."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.seed = int(get(cfg, "seed", 0))
        self.device, self.mesh = D.init_distributed(get(cfg, "device", "cpu"))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = D.dtype_option(cfg, "dtype", "fp32")
        self.param_dtype = D.dtype_option(cfg, "mixed_precision.param_dtype")  # None: compute in dtype
        self.reduce_dtype = D.dtype_option(cfg, "mixed_precision.reduce_dtype")  # None: reduce in param_dtype
        self.epochs = int(get(cfg, "epochs", 1))
        self.max_steps_per_epoch = get(cfg, "max_steps_per_epoch")
        self.batch_size = int(get(cfg, "batch_size", 4))  # per rank
        self.global_batch = self.batch_size * self.world
        self.grad_accum = int(get(cfg, "gradient_accumulation_steps", 1))
        self.clip = get(cfg, "clip_grad_norm")
        self.log_every = int(get(cfg, "log_every_n_steps", 1))
        self.save_every = get(cfg, "save_every_n_steps")
        self.checkpointer = Checkpointer(cfg)
        self.output_dir = self.checkpointer.output_dir
        self.quiet = bool(get(cfg, "quiet", False)) or self.rank != 0
        torch.manual_seed(self.seed)
        random.seed(self.seed)

    def setup(self) -> None:
        """Shard the model and load it a tensor at a time; data, optimizer; the recipe state when resuming."""
        resume_from = None  # the DCP recipe state folder
        if self.checkpointer.resume:
            resume_from = D.recipe_state_dir(Path(self.checkpointer.recipe_checkpoint or ""))
        progress = self._load_progress(resume_from) if resume_from is not None else None
        self.checkpointer.model_config()  # format, layout and config checks: no weights read yet
        with self.checkpointer.open_base() as base:
            model_cfg = base.config
            self.model = build_model(model_cfg, device="meta", dtype=self.dtype)
            D.shard_model(self.model, self.mesh, self.param_dtype, self.reduce_dtype,
                          bool(get(self.cfg, "enable_activation_checkpointing", False)))  # fmt: skip
            if resume_from is None:
                D.load_full_tensors(self.model, lambda k: base.tensors[k].get(), self.device)
            else:  # the weights saved with that state (DCP overwrites them below when the format rounds them)
                with open_checkpoint(resume_from.parent, model_type=self.checkpointer.model_type) as saved:
                    D.load_full_tensors(self.model, lambda k: saved.tensors[k].get(), self.device)
        self.model.train()
        self.rounds = any(self.checkpointer.dtypes[k] != dtype_name(self.dtype) for k in self.checkpointer.dtypes)

        tokenizer_dir = get(self.cfg, "tokenizer") or self.checkpointer.checkpoint_dir
        self.tokenizer = load_tokenizer(tokenizer_dir, model_cfg.eos_token_id)
        folder = Path(tokenizer_dir) if Path(tokenizer_dir).is_dir() else Path(tokenizer_dir).parent
        self.dataset = build_dataset(get(self.cfg, "dataset", {}), self.tokenizer, folder)
        self.pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
        batches = len(self.dataset) // self.global_batch // self.grad_accum
        if batches == 0:
            raise CkptkitError(
                f"dataset has {len(self.dataset)} samples, fewer than batch_size x ranks x gradient_accumulation_steps"
            )
        self.steps_per_epoch = min(batches, self.max_steps_per_epoch or batches)

        opt = get(self.cfg, "optimizer", {})
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=float(opt.get("lr", 2e-5)),
            betas=tuple(opt.get("betas", (0.9, 0.999))),
            weight_decay=float(opt.get("weight_decay", 0.0)),
        )
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
        if resume_from is not None and progress is not None:
            self._load_state(resume_from, progress)
        resumed = resume_from is not None
        self.metrics = None  # rank 0 logs
        if self.rank == 0:
            self.metrics = MetricLogger(self.output_dir, resumed, get(self.cfg, "wandb"), self.cfg)

    def _load_progress(self, path: Path) -> dict[str, Any]:
        """The saved position, checked against this run's schedule and global batch."""
        keys = D.recipe_state_keys(path)
        progress = {k: None for k in ("seed", "total_epochs", "max_steps_per_epoch", "epochs_run", "global_step",
                                      "steps_in_epoch", "global_batch", "world_size")}  # fmt: skip
        if not all(f"progress.{k}" in keys for k in progress):
            raise CkptkitError(f"{path}: not a ckptkit distributed recipe state; check checkpointer.recipe_checkpoint")
        state = {"progress": progress}
        D.load_recipe_state(path, state)
        self.checkpointer.check_state(progress, self.seed, self.epochs, self.max_steps_per_epoch)
        if progress["global_batch"] != self.global_batch:
            raise CkptkitError(
                f"{path}: was written with a global batch of {progress['global_batch']} samples "
                f"({progress['world_size']} ranks), this run has {self.global_batch} ({self.world} ranks x "
                f"batch_size {self.batch_size}); set batch_size to keep the global batch"
            )
        self._keys = keys
        return progress

    def _load_state(self, path: Path, progress: dict[str, Any]) -> None:
        state: dict[str, Any] = {
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.scheduler.state_dict(),
        }
        if any(k.startswith("model.") for k in self._keys):
            state["model"] = self.model.state_dict()
        if f"rng.rank_{self.rank}.torch" in self._keys:  # absent for ranks the saving run did not have
            state["rng"] = {f"rank_{self.rank}": rng_state()}
        D.load_recipe_state(path, state)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        if "rng" in state:
            set_rng_state(state["rng"][f"rank_{self.rank}"])
        self.epochs_run, self.global_step = progress["epochs_run"], progress["global_step"]
        self.steps_in_epoch = progress["steps_in_epoch"]

    def train(self) -> None:
        """Epochs of optimizer steps; checkpoints at epoch ends and every save_every_n_steps."""
        total_steps = self.epochs * self.steps_per_epoch
        self.progress = Progress(total_steps, self.global_step, self.quiet, self.log_every, str(self.device))
        with self.progress as progress:
            for epoch in range(self.epochs_run, self.epochs):
                batches = epoch_batches(len(self.dataset), self.global_batch, self.seed, epoch)
                while self.steps_in_epoch < self.steps_per_epoch:
                    start = time.perf_counter()
                    step_batches = batches[self.steps_in_epoch * self.grad_accum :][: self.grad_accum]
                    loss, tokens = self._step(step_batches)
                    self.steps_in_epoch += 1
                    self.global_step += 1
                    rate = tokens / (time.perf_counter() - start)
                    progress.update(self.global_step, epoch, loss, self.scheduler.get_last_lr()[0], rate, tokens)
                    if self.metrics is not None and self.global_step % self.log_every == 0:
                        self.metrics.log(
                            step=self.global_step, epoch=epoch, loss=loss,
                            lr=self.scheduler.get_last_lr()[0], tokens_per_second=rate,
                        )  # fmt: skip
                    due = self.save_every and self.global_step % int(self.save_every) == 0
                    if due and self.steps_in_epoch < self.steps_per_epoch:  # an epoch's end saves epoch_N
                        self._save(checkpoint_name("step", self.global_step, total_steps), epoch, final=False)
                self.epochs_run, self.steps_in_epoch = epoch + 1, 0
                name = checkpoint_name("epoch", epoch, self.epochs - 1)
                self._save(name, epoch + 1, final=self.epochs_run == self.epochs)
        self.finished = True

    def _step(self, step_batches: list[list[int]]) -> tuple[float, int]:
        """One optimizer step over gradient_accumulation_steps global batches; (mean loss, tokens).

        Each rank sums the token losses of its part; dividing by the step's token count over
        all its global batches (and multiplying by the ranks FSDP averages gradients over)
        gives exactly the single-device token-weighted mean.
        """
        sums = torch.zeros(len(step_batches), dtype=torch.float32, device=self.device)
        samples = [self.dataset[i] for indices in step_batches for i in indices]
        count = max(1, sum(t != IGNORE_INDEX for s in samples for t in s.labels[1:]))
        tokens = sum(len(s.ids) for s in samples)
        for j, indices in enumerate(step_batches):
            batch = collate([self.dataset[i] for i in D.mine(indices)], self.pad_id)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            logits = self.model(**model_inputs(batch))  # packed batches: document mask and positions
            loss_sum = F.cross_entropy(
                logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            (loss_sum * (self.world / count)).backward()
            sums[j] = loss_sum.detach()
        dist.all_reduce(sums)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (sums.sum() / count).item(), tokens

    def _save(self, name: str, epochs_run: int, final: bool) -> None:
        D.reset_peak_rss()
        before = D.rss_mib("VmRSS")
        weights = self.model.state_dict()
        state = None
        if not final:
            state = {
                "progress": {
                    "seed": self.seed,
                    "epochs_run": epochs_run,
                    "total_epochs": self.epochs,
                    "max_steps_per_epoch": self.max_steps_per_epoch,
                    "global_step": self.global_step,
                    "steps_in_epoch": self.steps_in_epoch,
                    "global_batch": self.global_batch,
                    "world_size": self.world,
                },
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                "lr_scheduler": self.scheduler.state_dict(),
                "rng": {f"rank_{self.rank}": rng_state()},
            }
            if self.rounds:  # the checkpoint's dtype rounds the weights: keep them at full precision too
                state["model"] = weights
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
        path = D.save_sharded(self.checkpointer, name, shapes, lambda k: D.full_tensor(weights[k]), state)
        rss = D.gather_objects((round(before), round(D.rss_mib())))  # per rank, MiB
        if self.metrics is not None:
            before_save, peak = [r[0] for r in rss], [r[1] for r in rss]
            self.metrics.event(
                checkpoint=str(path), step=self.global_step, rss_mib_before_save=before_save, peak_rss_mib_save=peak
            )
            self.progress.note(f"saved {path}")
            for gone in self.checkpointer.prune(self.steps_per_epoch):
                self.progress.note(f"deleted {gone} (checkpointer.keep_last_n_checkpoints)")
        dist.barrier()  # pruned before any rank goes on

    def cleanup(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            if hasattr(self, "progress"):  # what was reached, the checkpoints, how to resume a stopped run
                self.progress.summary(self.global_step, self.checkpointer, getattr(self, "finished", False))


def recipe_main(cfg: dict[str, Any]) -> None:
    ok = False
    try:
        cfg = validate_config(cfg, FullFinetuneDistributedConfig)  # one line per bad key, nothing written
        recipe = FullFinetuneDistributedRecipe(cfg)
        recipe.setup()
        try:
            recipe.train()
        finally:
            recipe.cleanup()
        ok = True
    finally:
        D.close_distributed(ok)


if __name__ == "__main__":
    import argparse
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args()
    try:
        recipe_main(load_config(args.config, overrides))
    except CkptkitError as e:
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"error: {rank}{e}", file=sys.stderr)
        D.exit_worker(1)
    D.exit_worker(0)
