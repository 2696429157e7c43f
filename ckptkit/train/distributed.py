"""What FSDP2 training needs: the process group from torchrun's environment,
FSDP2 sharding, loading full tensors one at a time into shards, and saving led by rank 0.

Saving never holds the whole model in one process: rank 0 runs the single-device
checkpointer (same format, file names, shard partition), and each tensor its writer
reaches is gathered then (``DTensor.full_tensor()``) while the other ranks follow rank 0's
lead through the same collectives. The optimizer, schedule, RNG (per rank) and data
position go into a DCP checkpoint, ``recipe_state/``, of which every rank writes its shards.
"""

from __future__ import annotations

import ctypes
import io
import os
import resource
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from ckptkit.errors import CkptkitError
from ckptkit.lazy import Lazy
from ckptkit.train.checkpointer import RECIPE_STATE_DIR, Checkpointer
from ckptkit.train.lora import decoder_layers

T = TypeVar("T")


def device_type(device: str) -> str:
    """The ``device`` config value (``cpu``, ``cuda``, ``auto``) as the device type to train on."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CkptkitError("device is cuda but no CUDA device is available; set device=cpu")
    if device not in ("cpu", "cuda"):
        raise CkptkitError(f"device must be cpu, cuda or auto, not {device!r}")
    return device


def init_distributed(device: str) -> tuple[torch.device, DeviceMesh]:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); without torchrun,
    a group of one. Returns this rank's device and the 1-D mesh FSDP shards over."""
    device = device_type(device)
    return_freed_memory()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:  # started by torchrun
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dev, init_device_mesh(dev.type, (dist.get_world_size(),))


def return_freed_memory() -> None:
    """Make glibc give freed buffers of 1 MiB and more back to the system at once.

    By default glibc raises its mmap threshold each time such a buffer is freed, after
    which same-sized tensors (gathered parameters, gradients, activations) come from the
    heap and their memory stays with the process: on a 58M-parameter model that kept
    ~250 MiB per rank more than the live tensors need. No-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def close_distributed(ok: bool) -> None:
    """Leave the process group; after a successful run, once every rank got here."""
    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """End a torchrun worker now. Its files are closed and written; the interpreter's own
    teardown can abort (``terminate called without an active exception``, no Python frame)
    when gloo's threads are destroyed late, which would turn a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    activation_checkpointing: bool,
) -> None:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, norm, output)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        if activation_checkpointing:
            layer.forward = lambda *a, f=layer.forward: checkpoint(f, *a, use_reentrant=False)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def load_full_tensors(model: nn.Module, full: Callable[[str], torch.Tensor], device: torch.device) -> None:
    """Fill a sharded model built on the meta device: ``full(name)`` reads one whole tensor,
    this rank keeps its shard of it and drops the rest before reading the next."""
    sharded = {}
    for name, param in model.state_dict().items():
        tensor = full(name).to(device, param.dtype)
        if isinstance(param, DTensor):
            mesh, placements = param.device_mesh, param.placements
            view = distribute_tensor(tensor, mesh, placements, src_data_rank=None).to_local()
            # a copy: the shard is a view that would keep the whole tensor alive
            tensor = DTensor.from_local(view.clone(), mesh, placements, shape=param.shape, stride=param.stride())
        sharded[name] = tensor
    model.load_state_dict(sharded, strict=True, assign=True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a sharded one)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def mine(indices: list[int]) -> list[int]:
    """This rank's part of one global batch, strided as ``DistributedSampler`` splits."""
    return indices[dist.get_rank() :: dist.get_world_size()]


def led_by_rank_zero(ops: dict[str, Callable[[Any], Any]], work: Callable[[Callable[[str, Any], Any]], T]) -> T | None:
    """Run ``work(lead)`` on rank 0; each ``lead(op, arg)`` it makes runs ``ops[op](arg)`` on
    every rank in the same order (ops may be collectives). Other ranks return None."""
    if dist.get_rank() == 0:

        def lead(op: str, arg: Any) -> Any:
            dist.broadcast_object_list([(op, arg)], src=0)
            return ops[op](arg)

        end: tuple[str, Any] = ("failed", "rank 0 stopped")
        try:
            result = work(lead)
            end = ("done", None)
            return result
        except BaseException as e:
            end = ("failed", str(e) or type(e).__name__)
            raise
        finally:
            dist.broadcast_object_list([end], src=0)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, arg = box[0]
        if op == "done":
            return None
        if op == "failed":
            raise CkptkitError(f"saving failed on rank 0: {arg}")
        ops[op](arg)


def save_sharded(
    checkpointer: Checkpointer,
    name: str,
    shapes: dict[str, tuple[int, ...]] | None,
    gather: Callable[[str], torch.Tensor],
    recipe_state: dict[str, Any] | None,
    adapter: Callable[[Path], None] | None = None,
) -> Path | None:
    """Write checkpoint ``name`` like the single-device checkpointer; every rank calls it.

    ``gather(key)`` (a collective) gives the full tensor the writer needs next (``shapes`` None:
    no model files, e.g. an adapter-only LoRA checkpoint); ``recipe_state``
    (sharded tensors and plain values) becomes ``recipe_state/`` (DCP); ``adapter(folder)``
    runs on rank 0. Returns the folder on rank 0.
    """

    def write(folder: Path) -> None:
        dcp.save(recipe_state, checkpoint_id=folder)

    def work(lead: Callable[[str, Any], Any]) -> Path:
        model = None if shapes is None else {k: Lazy(s, "", partial(lead, "gather", k)) for k, s in shapes.items()}

        def extra(folder: Path) -> None:
            if adapter is not None:
                adapter(folder)
            if recipe_state is not None:
                lead("recipe_state", folder / RECIPE_STATE_DIR)

        return checkpointer.save(name, model, extra=extra)

    path = led_by_rank_zero({"gather": gather, "recipe_state": write}, work)
    dist.barrier()
    return path


class _PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's loader unpickles non-tensor values with ``weights_only=False``; this one first
    checks each with ``weights_only=True`` (plain Python values and tensors only)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def recipe_state_dir(path: Path) -> Path:
    """``checkpointer.recipe_checkpoint``: a DCP recipe state folder, or a checkpoint folder holding one."""
    return path / RECIPE_STATE_DIR if (path / RECIPE_STATE_DIR / ".metadata").is_file() else path


def recipe_state_keys(path: Path) -> set[str]:
    """The (flattened) keys stored in a DCP recipe state, or a one-line error."""
    if not (path / ".metadata").is_file():
        raise CkptkitError(
            f"{path}: no distributed recipe state there; set checkpointer.recipe_checkpoint to a checkpoint's "
            f"{RECIPE_STATE_DIR} folder"
        )
    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:  # any unreadable metadata: the message says which file
        raise CkptkitError(f"{path}: unreadable recipe state metadata ({type(e).__name__})") from None


def load_recipe_state(path: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (sharded tensors are loaded in place, resharded to this world size)."""
    try:
        dcp.load(state, checkpoint_id=path, planner=_PlainValuesPlanner())
    except Exception as e:  # DCP wraps per-rank failures; report the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CkptkitError(f"{path}: cannot load the recipe state ({first})") from None


def gather_objects(value: T) -> list[T]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reset_peak_rss() -> None:
    """Restart this process's peak-RSS count (Linux ``clear_refs``); a no-op elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rss_mib(kind: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(kind + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
