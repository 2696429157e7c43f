"""The training loop of every recipe: full or LoRA fine-tuning, on one device or FSDP2.

A recipe is this loop plus two strategies: a :class:`~ckptkit.train.trainable.Trainable`
(what trains and what a save writes: :class:`~ckptkit.train.trainable.FullWeights`,
:class:`~ckptkit.train.trainable.LoRAAdapters`) and a
:class:`~ckptkit.train.placement.Placement` (how the model is placed and its state gathered
and saved: :class:`~ckptkit.train.placement.SingleDevice`,
:class:`~ckptkit.train.placement.FSDP2`). Everything else -- setup, data, validation split,
optimizer, schedule, gradient accumulation and clipping, compile, evaluation cadence,
logging, checkpoint cadence, resuming -- is written once, here.

``batch_size`` is per rank: N ranks with ``batch_size`` b take the same global batches, in
the same seeded order, as one device with ``batch_size`` N x b, and give the same losses.
Resuming restores weights (or adapters), optimizer, schedule, RNG and data position, so a
resumed run ends bitwise where an uninterrupted one does (at the same number of ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ckptkit.errors import CkptkitError
from ckptkit.io import signal_of, stopped_by, stopping_on_signals, tmp_beside
from ckptkit.tensors.dtypes import dtype_name
from ckptkit.train.checkpointer import Checkpointer, checkpoint_name, rng_state, set_rng_state
from ckptkit.train.config import config_path, load_config, parse_config
from ckptkit.train.data import build_datasets, collate, epoch_batches
from ckptkit.train.distributed import PeerFailed
from ckptkit.train.metrics import MetricLogger, Progress
from ckptkit.train.offload import ActivationOffload
from ckptkit.train.placement import FSDP2, Placement, Save, SingleDevice, open_source
from ckptkit.train.recipe_state import RecipeState, RunProgress
from ckptkit.train.schema import (
    FullFinetuneConfig,
    FullFinetuneDistributedConfig,
    LoRAFinetuneConfig,
    LoRAFinetuneDistributedConfig,
    RecipeConfig,
)
from ckptkit.train.step import (
    DTYPES,
    build_optimizer,
    build_scheduler,
    compile_layers,
    compiled_layers,
    evaluate,
    forward_backward,
    label_tokens,
    router_aux_weight,
)
from ckptkit.train.tokenizer import load_tokenizer, tokenizer_folder
from ckptkit.train.trainable import FullWeights, LoRAAdapters, Trainable
from ckptkit.train.transformer import build_model


class Recipe:
    """Setup, train, cleanup: epochs of optimizer steps over global batches, evaluation and
    checkpoints on their cadence, the same for every trainable and placement."""

    def __init__(self, cfg: RecipeConfig, trainable: Trainable, placement: Placement) -> None:
        self.cfg, self.trainable, self.placement = cfg, trainable, placement
        self.device = placement.device
        self.dtype = DTYPES[cfg.dtype]
        self.seed = cfg.seed
        self.global_batch = cfg.batch_size * placement.world_size
        self.writer = placement.rank == 0  # logs and writes checkpoints
        self.checkpointer = Checkpointer(cfg.checkpointer, cfg.resume_from_checkpoint, dtype_name(self.dtype))
        self.metrics: MetricLogger | None = None
        self.finished = False  # every epoch ran (set by the training loop)
        self.offload: ActivationOffload | None = None
        if cfg.enable_activation_offloading:  # on CPU to files in output_dir (a killed run's: swept at start)
            self.offload = ActivationOffload(self.device, tmp_beside(self.checkpointer.output_dir / "activations"))
        torch.manual_seed(self.seed)
        random.seed(self.seed)

    # --- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Model (and its saved state when resuming), data, optimizer, schedule, logging."""
        cfg, ckpt, placement = self.cfg, self.checkpointer, self.placement
        with placement.together():  # rank 0 looks; every rank stops on its verdict before any writes
            if self.writer:
                ckpt.check_fresh()
        progress = placement.read_progress(ckpt)
        if progress is not None:
            self._check_progress(progress)
        model_cfg = ckpt.model_config()  # format, layout and config checks: no weights read yet
        self.trainable.check(model_cfg)
        self.aux_weight = router_aux_weight(cfg.router_aux_loss_coef, model_cfg)
        from_folder = self.trainable.weights_from_resumed_checkpoint and not placement.weights_in_state()
        resumed = ckpt.resume_folder() if ckpt.resume and from_folder else None
        with ckpt.open_base() as base, contextlib.ExitStack() as stack:
            source = base if resumed is None else stack.enter_context(open_source(ckpt, resumed))
            self.model = build_model(base.config, device="meta", dtype=self.dtype)
            self.trainable.build(self.model, ckpt)
            if cfg.enable_activation_checkpointing:
                for layer in self.model.layers:
                    layer.forward = lambda *a, f=layer.forward: checkpoint(f, *a, use_reentrant=False)
            if self.offload is not None:
                self.offload.wrap(self.model)
            placement.place(self.model, self.trainable.source(self.model, lambda k: source.tensors[k].get()))
            self.trainable.placed(self.model)
        self.model.train()
        if cfg.compile:
            compile_layers(self.model)

        tokenizer_src = config_path("tokenizer", cfg.tokenizer) if cfg.tokenizer else ckpt.checkpoint_dir
        with tokenizer_folder(tokenizer_src) as folder:  # a GGUF's: rebuilt from it
            self.tokenizer = load_tokenizer(tokenizer_src, model_cfg.eos_token_id)
            self.dataset, self.val_dataset = build_datasets(cfg.dataset, self.tokenizer, folder, self.seed)
        self.pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
        batches = len(self.dataset) // self.global_batch // cfg.gradient_accumulation_steps
        if batches == 0:
            ranks = " x ranks" if placement.world_size > 1 else ""
            raise CkptkitError(
                f"dataset has {len(self.dataset)} samples, fewer than batch_size{ranks} x gradient_accumulation_steps"
            )
        self.steps_per_epoch = min(batches, cfg.max_steps_per_epoch or batches)
        self.total_steps = cfg.epochs * self.steps_per_epoch

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trainable, cfg.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_scheduler, self.total_steps)
        self.epochs_run, self.global_step, self.steps_in_epoch = 0, 0, 0
        if progress is not None:
            self._load_state(progress)
        with placement.together():  # the writing rank's setup: a failure there stops every rank
            self.trainable.prepare(ckpt, self.writer)
            if self.writer:
                self.metrics = MetricLogger(ckpt.output_dir, progress is not None, cfg.wandb, cfg.model_dump())
                self.metrics.event(setup=self.describe())

    def describe(self) -> dict[str, Any]:
        """How this run was set up, as it took effect (logged once to ``metrics.jsonl``)."""
        return {
            "world_size": self.placement.world_size,
            "device": self.device.type,
            "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "compiled_layers": compiled_layers(self.model),
            "optimizer_fused": bool(self.optimizer.defaults.get("fused")),
            "steps_per_epoch": self.steps_per_epoch,
            "validation_samples": len(self.val_dataset) if self.val_dataset is not None else 0,
        }

    def start_summary(self) -> list[str]:
        """What the run is about to do, printed before its first step."""
        cfg, info, model_cfg = self.cfg, self.describe(), self.model.config
        params = sum(p.numel() for p in self.model.parameters())
        trained = info["trainable_parameters"]
        valid = f" ({info['validation_samples']} for validation)" if info["validation_samples"] else ""
        ranks = f" on {info['world_size']} processes" if info["world_size"] > 1 else ""
        resumed = f", resuming after step {self.global_step}" if self.global_step else ""
        return [
            f"model: {model_cfg.model_type} from {self.checkpointer.checkpoint_dir}, {params:,} parameters, "
            f"{trained:,} trainable ({trained / params:.2%})",
            f"data: {len(self.dataset)} training samples{valid}, {self.steps_per_epoch} steps per epoch x "
            f"{cfg.epochs} epochs (0 to {cfg.epochs - 1}) = {self.total_steps} steps of {self.global_batch} samples",
            f"output: {self.checkpointer.output_dir}; {self.device.type}, {cfg.dtype}{ranks}{resumed}",
        ]

    def _check_progress(self, progress: RunProgress) -> None:
        """Refuse a recipe state of another schedule or global batch (the data position counts global batches)."""
        self.checkpointer.check_state(progress, self.seed, self.cfg.epochs, self.cfg.max_steps_per_epoch)
        saved = progress.global_batch
        if saved is not None and saved != self.global_batch:
            raise CkptkitError(
                f"{self.checkpointer.recipe_checkpoint}: was written with a global batch of {saved} samples "
                f"({progress.world_size} ranks), this run has {self.global_batch} ({self.placement.world_size} "
                f"ranks x batch_size {self.cfg.batch_size}); set batch_size to keep the global batch"
            )

    def _recipe_state(self, epochs_run: int) -> RecipeState:
        """What resuming needs besides the checkpoint's files."""
        progress = RunProgress(
            seed=self.seed,
            epochs_run=epochs_run,
            total_epochs=self.cfg.epochs,
            max_steps_per_epoch=self.cfg.max_steps_per_epoch,
            global_step=self.global_step,
            steps_in_epoch=self.steps_in_epoch,
            global_batch=self.global_batch,
            world_size=self.placement.world_size,
        )
        return RecipeState(
            progress,
            optimizer=self.placement.optimizer_state(self.model, self.optimizer),
            lr_scheduler=self.scheduler.state_dict(),
            rng=rng_state(),
            model=self.placement.model_state(self.trainable, self.model),
        )

    def _load_state(self, progress: RunProgress) -> None:
        state = self.placement.load_state(self._recipe_state(0))
        if state.model is not None:  # full precision where the checkpoint's dtype rounds; FSDP2: what trains
            self.model.load_state_dict(state.model, strict=False)  # (LoRA: the adapters only)
        self.placement.set_optimizer_state(self.model, self.optimizer, state.optimizer)
        self.scheduler.load_state_dict(state.lr_scheduler)
        if state.rng is not None:
            set_rng_state(state.rng)
        self.epochs_run, self.global_step = progress.epochs_run, progress.global_step
        self.steps_in_epoch = progress.steps_in_epoch

    # --- training ------------------------------------------------------------------------
    def train(self) -> None:
        """Epochs of optimizer steps; evaluation every ``eval_every_n_steps`` (else at each
        epoch end); checkpoints at epoch ends and every ``save_every_n_steps``."""
        cfg = self.cfg
        eval_every, save_every, accum = cfg.eval_every_n_steps, cfg.save_every_n_steps, cfg.gradient_accumulation_steps
        quiet = cfg.quiet or not self.writer
        self.progress = Progress(self.total_steps, self.global_step, quiet, cfg.log_every_n_steps, str(self.device))
        with self.progress as progress:
            for line in self.start_summary():
                progress.note(line)
            for epoch in range(self.epochs_run, cfg.epochs):
                batches = epoch_batches(len(self.dataset), self.global_batch, self.seed, epoch)
                while self.steps_in_epoch < self.steps_per_epoch:
                    start = time.perf_counter()
                    loss, tokens = self._step(batches[self.steps_in_epoch * accum :][:accum])
                    self.steps_in_epoch += 1
                    self.global_step += 1
                    rate = tokens / (time.perf_counter() - start)
                    lr = float(self.scheduler.get_last_lr()[0])
                    progress.update(self.global_step, epoch, loss, lr, rate, tokens)
                    if self.metrics is not None and self.global_step % cfg.log_every_n_steps == 0:
                        self.metrics.log(step=self.global_step, epoch=epoch, loss=loss, lr=lr, tokens_per_second=rate)
                    if eval_every and self.global_step % eval_every == 0:
                        self._evaluate(epoch)
                    due = save_every and self.global_step % save_every == 0
                    if due and self.steps_in_epoch < self.steps_per_epoch:  # an epoch's end saves epoch_N
                        name = checkpoint_name("step", self.global_step, self.total_steps)
                        self._save(name, epoch, final=False, epoch_end=False)
                self.epochs_run, self.steps_in_epoch = epoch + 1, 0
                if not eval_every or self.global_step % eval_every:
                    self._evaluate(epoch)
                name = checkpoint_name("epoch", epoch, cfg.epochs - 1)
                self._save(name, epoch + 1, final=self.epochs_run == cfg.epochs)
        self.finished = True

    def _step(self, step_batches: list[list[int]]) -> tuple[float, int]:
        """One optimizer step over ``gradient_accumulation_steps`` global batches, every label
        token weighted equally; (mean loss per label token, input tokens of the global batches)."""
        placement = self.placement
        samples = [self.dataset[i] for indices in step_batches for i in indices]
        parts = [collate([self.dataset[i] for i in placement.mine(indices)], self.pad_id) for indices in step_batches]
        stats = forward_backward(
            self.model,
            parts,
            self.device,
            label_tokens(samples),
            placement.world_size,
            placement.reduce,
            aux_weight=self.aux_weight,
        )
        if self.cfg.clip_grad_norm:  # on sharded gradients the norm is reduced over all ranks
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats.loss, sum(len(s.ids) for s in samples)

    def _evaluate(self, epoch: int) -> None:
        """Mean loss per label token on the validation set, when there is one."""
        if self.val_dataset is None:
            return
        p = self.placement
        loss = evaluate(
            self.model, self.val_dataset, self.cfg.batch_size, self.pad_id, self.device, p.rank, p.world_size, p.reduce
        )
        p.after_forward_only(self.model)
        if self.metrics is not None:
            self.metrics.log(step=self.global_step, epoch=epoch, eval_loss=loss)

    def _save(self, name: str, epochs_run: int, final: bool, epoch_end: bool = True) -> None:
        model, trainable, ckpt = self.model, self.trainable, self.checkpointer
        save = Save(
            name,
            None if final else self._recipe_state(epochs_run),
            model.state_dict(),
            sharded=lambda: trainable.sharded_tensors(model),
            files=lambda full: trainable.model_files(model, full, final),
            extra=lambda full: trainable.extra(model, full, ckpt),
            epoch_end=epoch_end,
        )
        path, logged = self.placement.save(ckpt, save)
        with self.placement.together():  # pruned before any rank goes on; a failure stops every rank
            if final:  # the run ends with every checkpoint in place
                self.placement.wait()
            if self.metrics is not None:
                self.metrics.event(checkpoint=str(path), step=self.global_step, **logged)
                self.progress.note(f"saved {path}" if final or not logged.get("async") else f"saving {path}")
                for gone in ckpt.prune(self.steps_per_epoch):
                    self.progress.note(f"deleted {gone} (checkpointer.keep_last_n_checkpoints)")

    def cleanup(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.metrics is not None:
            self.metrics.close()
            if hasattr(self, "progress"):  # what was reached, the checkpoints, how to resume a stopped run
                self.progress.summary(self.global_step, self.checkpointer, self.finished)


# --- the bundled recipes: schema and strategies --------------------------------------------
def _full(cfg: Any) -> Trainable:
    return FullWeights()


def _lora(cfg: Any) -> Trainable:
    return LoRAAdapters(cfg.lora)


RECIPES: dict[str, tuple[type[RecipeConfig], Callable[[Any], Trainable], type[Placement]]] = {
    "full_finetune": (FullFinetuneConfig, _full, SingleDevice),
    "lora_finetune": (LoRAFinetuneConfig, _lora, SingleDevice),
    "full_finetune_distributed": (FullFinetuneDistributedConfig, _full, FSDP2),
    "lora_finetune_distributed": (LoRAFinetuneDistributedConfig, _lora, FSDP2),
}
"""Each bundled recipe: its config schema, its trainable and its placement."""


def run(raw: dict[str, Any], recipe: str) -> None:
    """Run bundled recipe ``recipe`` on config ``raw`` (validated first: one line per bad key, nothing written)."""
    schema, trainable, placement = RECIPES[recipe]
    ok = False
    try:
        cfg = parse_config(raw, schema)
        loop = Recipe(cfg, trainable(cfg), placement(cfg))
        loop.setup()
        try:
            loop.train()
        finally:
            loop.cleanup()
        ok = True
    finally:
        placement.close(ok)


def entry_point(recipe: str, module: str, doc: str | None) -> Callable[[dict[str, Any]], None]:
    """``recipe_main(cfg)`` of bundled recipe ``recipe``; when ``module`` is ``__main__`` (``python -m``,
    torchrun, a copied file run as a script), parse the command line and run it first."""

    def recipe_main(cfg: dict[str, Any]) -> None:
        run(cfg, recipe)

    if module == "__main__":
        main(recipe, doc or recipe)
    return recipe_main


def main(recipe: str, doc: str) -> None:
    """``python -m ckptkit.train.recipes.RECIPE --config CONFIG [key=value ...]`` (or under torchrun)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args()
    code = 0
    with stopping_on_signals():  # Ctrl-C, SIGTERM, SIGHUP: rank 0's summary says where it got to
        try:
            run(load_config(args.config, overrides), recipe)
        except KeyboardInterrupt as stop:
            code = 128 + signal_of(stop)
        except CkptkitError as e:
            if stopped_by() is None:
                code = 1
                if not isinstance(e, PeerFailed):  # the rank where it failed says it, once
                    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
                    sys.stderr.write(f"error: {rank}{e}\n")  # one write: the ranks' lines do not interleave
        except Exception:
            if stopped_by() is None:
                raise
        stop_signal = stopped_by()  # an error after a stop: a peer rank that stopped first
        if stop_signal is not None:
            code = 128 + stop_signal
    if RECIPES[recipe][2].launched_by_torchrun:
        from ckptkit.train.distributed import exit_worker

        exit_worker(code)  # a torchrun worker's teardown can abort after a finished run
    sys.exit(code)
