"""Where the model lives and how its state is gathered and saved: one device, or FSDP2.

The training loop (:mod:`ckptkit.train.loop`) asks a placement to put the model's weights
in place, to split each global batch, to sum values over ranks, to gather a tensor whole,
and to write and read the recipe state. :class:`SingleDevice` is the trivial case (a world
of one); :class:`FSDP2` shards every decoder layer and the root with ``fully_shard`` over
the process group torchrun describes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.errors import CkptkitError
from ckptkit.plan import dequantized_checkpoint
from ckptkit.tensors.lazy import Lazy
from ckptkit.train import distributed as D
from ckptkit.train import nf4
from ckptkit.train.checkpointer import RECIPE_STATE_DIR, Checkpointer
from ckptkit.train.recipe_state import RecipeState, RunProgress
from ckptkit.train.schema import MixedPrecisionConfig, RecipeConfig
from ckptkit.train.step import DTYPES, Reduce
from ckptkit.train.trainable import Gather, ModelFiles, Trainable

TensorSource = Callable[[str], torch.Tensor]
"""A whole tensor by canonical name (read from a checkpoint, or gathered from shards)."""


@dataclass
class Save:
    """One checkpoint to write.

    ``state``: the recipe state (None: a final checkpoint). ``tensors``: the model's state dict as placed;
    ``sharded()``: the part a sharded checkpoint keeps (``Trainable.sharded_tensors``).
    ``files(full)`` and ``extra(full)`` are the trainable's model files and extras, given
    ``full``, a whole tensor by name. ``epoch_end``: an ``epoch_N`` checkpoint (a sharded
    save converts model files for those only; ``step_N`` ones keep the sharded state).
    """

    name: str
    state: RecipeState | None
    tensors: dict[str, torch.Tensor]
    sharded: Callable[[], dict[str, torch.Tensor]]
    files: Callable[[Gather], ModelFiles | None]
    extra: Callable[[Gather], Callable[[Path], None] | None]
    epoch_end: bool = True


class Placement:
    """How the model is placed on devices and how its state is gathered and saved."""

    launched_by_torchrun: ClassVar[bool] = False
    device: torch.device
    rank: int = 0
    world_size: int = 1
    reduce: Reduce | None = None  # sums a tensor over ranks in place; None on one device

    def __init__(self, cfg: RecipeConfig) -> None:
        self.device = torch.device("cpu")

    def place(self, model: nn.Module, source: TensorSource) -> None:
        """Give every parameter of ``model`` still on the meta device its value from ``source``."""
        raise NotImplementedError

    def mine(self, indices: list[int]) -> list[int]:
        """This rank's part of one global batch, strided as ``DistributedSampler`` splits."""
        return indices[self.rank :: self.world_size]

    def model_state(self, trainable: Trainable, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The model tensors the recipe state keeps (None: none beyond the checkpoint's files)."""
        return trainable.state_tensors(model)

    def weights_in_state(self) -> bool:
        """Whether the recipe state being resumed holds the trained weights themselves (then
        the model starts from the base and takes them from there)."""
        return False

    def read_progress(self, checkpointer: Checkpointer) -> RunProgress | None:
        """The saved position when resuming (None otherwise); the rest is read by ``load_state``."""
        raise NotImplementedError

    def load_state(self, template: RecipeState) -> RecipeState:
        """The saved optimizer, scheduler, RNG (this rank's; None for a rank the saving run did
        not have) and model tensors (when saved) in the shape of ``template``; its progress is
        the template's (``read_progress`` read the saved one)."""
        raise NotImplementedError

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def set_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save(self, checkpointer: Checkpointer, save: Save) -> tuple[Path | None, dict[str, Any]]:
        """Write checkpoint ``save.name`` (asynchronously where configured: :meth:`wait`);
        returns the folder (on the writing rank) and what to log with the checkpoint event."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until every checkpoint this rank started is written (and, on the writer, published)."""

    def after_forward_only(self, model: nn.Module) -> None:
        """Put the model back as training expects it after forwards without backward (evaluation)."""

    def together(self) -> contextlib.AbstractContextManager[None]:
        """A block every rank runs (e.g. what only the writing rank does in it), leaving it
        together: when it fails on one rank it fails on all, with that rank's one line."""
        return contextlib.nullcontext()

    @staticmethod
    def close(ok: bool) -> None:
        """After the run (``ok``: it finished) or a failure."""


class SingleDevice(Placement):
    """One CPU or CUDA device; the recipe state is ``recipe_state/recipe_state.pt``."""

    def __init__(self, cfg: RecipeConfig) -> None:
        if cfg.checkpointer.async_save:
            raise CkptkitError(
                "checkpointer.async_save applies to the sharded checkpoints of the _distributed recipes; "
                "remove it or run the _distributed recipe"
            )
        self.device = torch.device(D.device_type(cfg.device))
        self._state: RecipeState | None = None

    def place(self, model: nn.Module, source: TensorSource) -> None:
        """QLoRA's weights (NF4 on the meta device) are quantized on the device one at a time, as
        read: the 16-bit decoder is never on the device (nor in memory) whole."""
        missing = {}
        for key, value in model.state_dict().items():
            if value.is_meta:
                tensor = source(key).to(value.dtype)
                missing[key] = nf4.to_nf4(tensor.to(self.device)) if nf4.is_nf4(value) else tensor
        model.load_state_dict(missing, strict=False, assign=True)
        model.to(self.device)

    def model_state(self, trainable: Trainable, model: nn.Module) -> dict[str, torch.Tensor] | None:
        tensors = trainable.state_tensors(model)
        return None if tensors is None else {k: v.detach().cpu() for k, v in tensors.items()}

    def read_progress(self, checkpointer: Checkpointer) -> RunProgress | None:
        state = checkpointer.load_recipe_state()
        if state is None:
            return None
        self._state = state
        return state.progress

    def load_state(self, template: RecipeState) -> RecipeState:
        saved = self._state
        assert saved is not None, "read_progress first"
        model = saved.model if template.model is not None else None
        return RecipeState(template.progress, saved.optimizer, saved.lr_scheduler, saved.rng, model)

    def save(self, checkpointer: Checkpointer, save: Save) -> tuple[Path | None, dict[str, Any]]:
        full = save.tensors.__getitem__
        files = save.files(full)
        weights = None if files is None else {k: files[1](k) for k in files[0]}
        flat = None if save.state is None else save.state.flat()
        return checkpointer.save(save.name, weights, recipe_state=flat, extra=save.extra(full)), {}


class FSDP2(Placement):
    """FSDP2 over the ranks torchrun started (a group of one without torchrun).

    A checkpoint is one DCP checkpoint, ``recipe_state/``, of which every rank writes its own
    shards (the model, optimizer, schedule, data position, RNG); nothing is gathered. Rank 0
    then converts the model files of ``epoch_N`` checkpoints (the input's format) by streaming
    from those shards, and publishes the folder. ``checkpointer.async_save``: the shards are
    written by ``dcp.async_save`` over a process group of their own while training goes on
    (one save in flight; the next save, and the end of the run, wait for it)."""

    launched_by_torchrun = True

    def __init__(self, cfg: RecipeConfig) -> None:
        mixed_precision = getattr(cfg, "mixed_precision", None) or MixedPrecisionConfig()
        self.device, self.mesh = D.init_distributed(cfg.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.param_dtype = DTYPES[mixed_precision.param_dtype] if mixed_precision.param_dtype else None
        self.reduce_dtype = DTYPES[mixed_precision.reduce_dtype] if mixed_precision.reduce_dtype else None
        self.reduce = dist.all_reduce
        self._path = Path()
        self._keys: set[str] = set()
        self._group = dist.new_group(backend="gloo") if cfg.checkpointer.async_save else None
        self._pending: D.Pending | None = None

    def place(self, model: nn.Module, source: TensorSource) -> None:
        made = {k: v for k, v in model.state_dict().items() if not v.is_meta}  # e.g. LoRA adapters, on the CPU
        # one LoRA A shared by a fused module's parts (an expert's gate and up) stays one
        # parameter: sharded once in its layer, its gradient the sum of both uses, as on one device
        tied = D.tied_parameters(model)
        model.to("meta")
        D.tie_parameters(model, tied)
        if any(nf4.local_is_nf4(p) for p in model.parameters()):  # QLoRA: the NF4 layout, on the meta device
            nf4.check_shardable(model, self.world_size)
        D.shard_model(model, self.mesh, self.param_dtype, self.reduce_dtype)
        D.load_full_tensors(model, lambda k: made[k] if k in made else source(k), self.device, tied)

    def model_state(self, trainable: Trainable, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return trainable.sharded_tensors(model)

    def weights_in_state(self) -> bool:
        return any(k.startswith("model.") for k in self._keys)

    def read_progress(self, checkpointer: Checkpointer) -> RunProgress | None:
        if not checkpointer.resume:
            return None
        self._path = path = D.recipe_state_dir(Path(checkpointer.recipe_checkpoint or ""))
        self._keys = keys = D.recipe_state_keys(path)
        progress: dict[str, Any] = dict.fromkeys(RunProgress.keys())
        if not all(f"progress.{k}" in keys for k in progress):
            raise CkptkitError(f"{path}: not a ckptkit distributed recipe state; check checkpointer.recipe_checkpoint")
        D.load_recipe_state(path, {"progress": progress})
        return RunProgress.from_dict(progress)

    def load_state(self, template: RecipeState) -> RecipeState:
        tree = template.tree()
        state = {k: v for k, v in tree.items() if k not in ("progress", "rng") and f"{k}." in self._prefixes()}
        mine = f"rank_{self.rank}"
        if f"rng.{mine}.torch" in self._keys:  # absent for ranks the saving run did not have
            state["rng"] = {mine: template.rng}
        D.load_recipe_state(self._path, state)
        rng = state["rng"][mine] if "rng" in state else None
        return RecipeState(template.progress, state["optimizer"], state["lr_scheduler"], rng, state.get("model"))

    def _prefixes(self) -> set[str]:
        """The first part of every key of the state being resumed, with its dot."""
        return {k.split(".", 1)[0] + "." for k in self._keys}

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def set_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)

    def save(self, checkpointer: Checkpointer, save: Save) -> tuple[Path | None, dict[str, Any]]:
        with self.together():  # one save in flight; its publishing failed on rank 0: every rank stops
            self.wait()
        D.reset_peak_rss()
        before, start = D.rss_mib("VmRSS"), time.perf_counter()
        state: dict[str, Any] = {"model": save.sharded()}
        if save.state is not None:
            state = {**save.state.tree(), **state, "rng": {f"rank_{self.rank}": save.state.rng}}
        # what needs the model is taken now: the files are written while training goes on
        dtypes = {k: v.dtype for k, v in save.tensors.items()}
        source: dict[str, Gather] = {}
        files = save.files(lambda k: source["full"](k)) if save.epoch_end else None
        extra = save.extra(lambda k: source["full"](k))
        finish = partial(_finish, checkpointer, files, extra, dtypes, source, save.state is not None)
        self._pending = D.save_sharded(checkpointer, save.name, state, finish, self._group)
        blocked = time.perf_counter() - start
        rss = D.gather_objects((round(before), round(D.rss_mib())))  # per rank, MiB
        logged: dict[str, Any] = {"rss_mib_before_save": [r[0] for r in rss], "peak_rss_mib_save": [r[1] for r in rss]}
        logged |= {"save_seconds": round(blocked, 3), "async": self._group is not None}
        return (checkpointer.output_dir / save.name if self.rank == 0 else None), logged

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def after_forward_only(self, model: nn.Module) -> None:
        # FSDP2 keeps the root's parameters gathered after a forward until its backward; without
        # one (evaluation) they would stay gathered, and unknown to the optimizer's state dict
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def together(self) -> contextlib.AbstractContextManager[None]:
        return D.failing_together()

    @staticmethod
    def close(ok: bool) -> None:
        D.close_distributed(ok)


def _finish(
    checkpointer: Checkpointer,
    files: ModelFiles | None,
    extra: Callable[[Path], None] | None,
    dtypes: dict[str, torch.dtype],
    source: dict[str, Gather],
    keep_state: bool,
    folder: Path,
) -> None:
    """On rank 0 once every shard of ``folder/recipe_state`` is written: the model files,
    converted by streaming from the shards with ckptkit's DCP reader (``source["full"]``; a
    tensor the shards do not hold, e.g. a frozen LoRA base, is read from the input), and the
    extras (LoRA: the adapter); a final checkpoint (``keep_state`` false) keeps no recipe state."""
    import shutil

    shards = folder / RECIPE_STATE_DIR
    reader = D.sharded_model(shards)
    with contextlib.ExitStack() as stack:
        base: list[Checkpoint] = []

        def full(key: str) -> torch.Tensor:
            if key in reader.entries:
                return reader.read(key)
            if not base:
                base.append(stack.enter_context(checkpointer.open_base()))
            return base[0].tensors[key].get().to(dtypes[key])

        source["full"] = full
        if files is not None:
            shapes, tensor = files
            checkpointer.write_model(folder, {k: Lazy(s, "", partial(tensor, k)) for k, s in shapes.items()})
        if extra is not None:
            extra(folder)
    if not keep_state:
        shutil.rmtree(shards)


def open_source(checkpointer: Checkpointer, folder: Path | None) -> Checkpoint:
    """The checkpoint the weights come from: the base, or ``folder`` (one saved by this recipe)."""
    if folder is None:
        return checkpointer.open_base()
    saved = open_checkpoint(checkpointer.model_in(folder), model_type=checkpointer.model_type)
    return dequantized_checkpoint(saved, checkpointer.base_dtype)
