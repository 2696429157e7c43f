"""LoRA fine-tuning on several devices or nodes: FSDP2 launched by torchrun.

Run it as ``ckptkit run --nproc-per-node N lora_finetune_distributed --config CONFIG [key=value ...]``
or as ``torchrun --nproc-per-node N -m ckptkit.train.recipes.lora_finetune_distributed --config ...``.

Base weights stay frozen and sharded; low-rank adapters train on the chosen projections.
``batch_size`` is per rank, so N ranks with ``batch_size`` b take the same global batches,
in the same seeded order, as ``lora_finetune`` with ``batch_size`` N x b, from the same
adapter initialisation, and give the same losses. Each checkpoint holds the merged weights
in the input's format, file names and shard partition (gathered and merged one tensor at
a time), the adapter in PEFT's format in ``adapter/``, and ``recipe_state/`` (DCP: adapter,
sharded optimizer state, schedule, RNG per rank, data position). Resuming at the same
world size is bitwise exact; at another world size (same global batch) DCP reshards.
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

from ckptkit.errors import CkptkitError
from ckptkit.train import distributed as D
from ckptkit.train.checkpointer import ADAPTER_DIR, Checkpointer, checkpoint_name, rng_state, set_rng_state
from ckptkit.train.config import get, load_config, validate_config
from ckptkit.train.data import IGNORE_INDEX, build_dataset, collate, epoch_batches
from ckptkit.train.lora import apply_lora, lora_modules, merged_weight
from ckptkit.train.lora_targets import check_targets
from ckptkit.train.metrics import MetricLogger, Progress
from ckptkit.train.peft_io import prepare_for_peft, save_adapter
from ckptkit.train.schema import LoRAFinetuneDistributedConfig
from ckptkit.train.step import model_inputs
from ckptkit.train.tokenizer import load_tokenizer
from ckptkit.train.transformer import build_model


class LoRAFinetuneDistributedRecipe:
    """Trains LoRA adapters of the FSDP2-sharded model with AdamW, warmup + cosine schedule."""

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
        model_cfg = self.checkpointer.model_config()  # format, layout and config checks: no weights read yet
        check_targets(get(self.cfg, "lora.targets"), model_cfg)
        with self.checkpointer.open_base() as base:
            model_cfg = base.config
            self.model = build_model(model_cfg, device="meta", dtype=self.dtype)
            lora = get(self.cfg, "lora", {})
            apply_lora(
                self.model,
                targets=lora.get("targets", ["q", "v"]),
                rank=int(lora.get("rank", 8)),
                alpha=float(lora.get("alpha", 16)),
                dropout=float(lora.get("dropout", 0.0)),
            )
            for module in lora_modules(self.model).values():  # on the CPU in module order: lora_finetune's draws
                module.reset_lora(torch.device("cpu"), module.lora_a.dtype)
            prepare_for_peft(self.model)  # PEFT names checked now, not at save
            adapters = self._adapter_state()
            if len({t.data_ptr() for t in adapters.values()}) < len(adapters):
                raise CkptkitError(
                    f"LoRA on the fused modules of {model_cfg.model_type} (one shared A) is not supported by "
                    "lora_finetune_distributed yet; use lora_finetune or other lora.targets"
                )
            self.model.to("meta")
            D.shard_model(self.model, self.mesh, self.param_dtype, self.reduce_dtype,
                          bool(get(self.cfg, "enable_activation_checkpointing", False)))  # fmt: skip
            # the base, also when resuming (the adapter then comes from the recipe state)
            base_or_adapter = lambda k: adapters[k] if k in adapters else base.tensors[k].get()
            D.load_full_tensors(self.model, base_or_adapter, self.device)
        self.model.train()

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
        if self.rank == 0:
            self.checkpointer.prepare_peft_base()  # an HF base for the adapters' base_model_name_or_path
        dist.barrier()
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
        state["model"] = self._adapter_state()
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
        adapters = {k: D.full_tensor(v).cpu() for k, v in self._adapter_state().items()}  # small; all ranks gather
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
                "model": self._adapter_state(),
            }
        modules = lora_modules(self.model)

        def merged(key: str) -> torch.Tensor:
            name = key.removesuffix(".weight")
            if name not in modules or not key.endswith(".weight"):
                return D.full_tensor(weights[key])
            w, a, b = (D.full_tensor(weights[f"{name}.{part}"]) for part in ("weight", "lora_a", "lora_b"))
            return merged_weight(w, a, b, modules[name].scaling)

        def adapter(folder: Path) -> None:
            base = self.checkpointer.peft_base or None
            save_adapter(self.model, folder / ADAPTER_DIR, base_model_name_or_path=base, weights=adapters)

        when = get(self.cfg, "lora.save_merged")
        shapes = None  # an adapter-only checkpoint, unless merged weights are due
        if when == "every" or (final and when == "final"):
            shapes = {k: tuple(v.shape) for k, v in weights.items() if not k.endswith((".lora_a", ".lora_b"))}
        path = D.save_sharded(self.checkpointer, name, shapes, merged, state, adapter)
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

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """The trainable (adapter) tensors, sharded."""
        return {k: v for k, v in self.model.state_dict().items() if k.endswith((".lora_a", ".lora_b"))}

    def cleanup(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            if hasattr(self, "progress"):  # what was reached, the checkpoints, how to resume a stopped run
                self.progress.summary(self.global_step, self.checkpointer, getattr(self, "finished", False))


def recipe_main(cfg: dict[str, Any]) -> None:
    ok = False
    try:
        cfg = validate_config(cfg, LoRAFinetuneDistributedConfig)  # one line per bad key, nothing written
        recipe = LoRAFinetuneDistributedRecipe(cfg)
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
