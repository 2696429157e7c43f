"""What FSDP2 training needs: the process group from torchrun's environment,
FSDP2 sharding, loading full tensors one at a time into shards, and sharded saving.

Saving gathers nothing: every rank writes its own shards of the model, optimizer state,
schedule, RNG (per rank) and data position as one PyTorch Distributed Checkpoint (DCP),
``recipe_state/``, with ``dcp.save`` or, overlapping the next steps, ``dcp.async_save``.
When every shard is written, rank 0 converts the model files (the input's format) by
streaming from those shards with ckptkit's DCP reader, one tensor at a time, and publishes
the folder atomically.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import resource
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
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

from ckptkit.errors import CkptkitError
from ckptkit.formats.dcp import DcpCheckpoint, holds_checkpoint, open_state, state_keys
from ckptkit.train import nf4
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
) -> None:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, norm, output)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under more than one name (e.g. the LoRA A
    that a fused module's parts share), in module order. FSDP2 keeps such a parameter one
    within one ``fully_shard`` unit: these are within one decoder layer."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie_parameters(model: nn.Module, tied: Sequence[Sequence[str]]) -> None:
    """Make each group of :func:`tied_parameters` one parameter again, the first name's
    (``to()`` and ``load_state_dict(assign=True)`` give every name a tensor of its own)."""
    for first, *rest in tied:
        param = model.get_parameter(first)
        for name in rest:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, param)


def load_full_tensors(
    model: nn.Module, full: Callable[[str], torch.Tensor], device: torch.device, tied: Sequence[Sequence[str]] = ()
) -> None:
    """Fill a sharded model built on the meta device: ``full(name)`` reads one whole tensor,
    this rank keeps its shard of it and drops the rest before reading the next. A parameter
    held under several names (``tied``, which :func:`shard_model` kept one) is read once."""
    again = {name for group in tied for name in group[1:]}
    sharded = {}
    for name, param in model.state_dict().items():
        if name in again:
            continue
        tensor = full(name).to(device, param.dtype)
        if isinstance(param, DTensor):
            mesh, placements = param.device_mesh, param.placements
            if nf4.local_is_nf4(param):  # QLoRA: quantized whole, each rank keeps its rows' blocks
                local = nf4.shard(nf4.to_nf4(tensor), mesh.size(), mesh.get_local_rank())
            else:  # a copy: the shard is a view that would keep the whole tensor alive
                local = distribute_tensor(tensor, mesh, placements, src_data_rank=None).to_local().clone()
            tensor = DTensor.from_local(local, mesh, placements, shape=param.shape, stride=param.stride())
        sharded[name] = tensor
    missing, unexpected = model.load_state_dict(sharded, strict=False, assign=True)
    if set(missing) != again or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {sorted(set(missing) - again)}, unexpected {unexpected}")
    tie_parameters(model, tied)


class Pending:
    """One checkpoint being written: every rank's shards into the writer's temporary folder,
    then, on rank 0 once all of them are written, ``finish(folder)`` (the model files converted
    from the shards, extras) and the folder published under its name. Synchronous saves are
    done when this is made; ``async_save`` ones finish in a thread of rank 0 while training
    goes on; :meth:`wait` joins it and raises what failed there."""

    def __init__(self, future: Future[Any] | None, publish: Callable[[], None] | None) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._future = future
        if publish is None:  # not the writing rank: only the write of its shards
            return
        if future is None:
            publish()
            return

        def run() -> None:
            try:
                future.result()
                publish()
            except BaseException as e:  # re-raised in the main thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="ckptkit-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until this rank's part is done (rank 0: published); re-raises a failure of the write."""
        if self._thread is not None:
            self._thread.join()
        elif self._future is not None:
            self._future.result()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def publish(name: str, stack: contextlib.ExitStack, finish: Callable[[], None]) -> None:
    """Rank 0, once every rank's shards are written: ``finish()`` then put checkpoint ``name``
    in place (leaving ``stack``, which holds its publishing); a failure removes the folder."""
    try:
        finish()
    except BaseException:
        if not stack.__exit__(*sys.exc_info()):
            raise
        return
    stack.close()


def save_sharded(
    checkpointer: Checkpointer,
    name: str,
    state: dict[str, Any],
    finish: Callable[[Path], None],
    group: dist.ProcessGroup | None = None,
) -> Pending:
    """Write checkpoint ``name``: every rank writes its own shards of ``state`` (DTensors and
    plain values) as a DCP checkpoint in ``recipe_state/`` of the folder rank 0 publishes,
    then rank 0 runs ``finish(folder)`` and publishes it. Nothing is gathered. ``group``: write
    with ``dcp.async_save`` over that process group (the next steps run meanwhile); None:
    ``dcp.save``. Every rank calls it."""
    stack = contextlib.ExitStack()
    box: list[Any] = [None]
    with failing_together():  # rank 0 refused the folder (its lock held, not writable): every rank stops
        if dist.get_rank() == 0:
            box[0] = stack.enter_context(checkpointer.publishing(name))
    try:
        dist.broadcast_object_list(box, src=0)
        folder = Path(box[0])
        target = folder / RECIPE_STATE_DIR
        future: Future[Any] | None = None
        if group is None:
            dcp.save(state, checkpoint_id=target)
        else:
            response: Any = dcp.async_save(state, checkpoint_id=target, process_group=group)
            future = getattr(response, "upload_completion", response)  # AsyncSaveResponse or a Future
    except BaseException:
        if not stack.__exit__(*sys.exc_info()):
            raise
        raise
    with failing_together():  # a synchronous save publishes here: its failure on rank 0 stops every rank
        return Pending(future, partial(publish, name, stack, partial(finish, folder)) if dist.get_rank() == 0 else None)


def sharded_model(folder: Path) -> DcpCheckpoint:
    """The model tensors (``model.`` keys, canonical names) of a DCP recipe state, read by
    ckptkit's DCP reader: each tensor stitched from the ranks' chunks when read, one at a time."""
    return open_state(folder, "model.")


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
    return path / RECIPE_STATE_DIR if holds_checkpoint(path / RECIPE_STATE_DIR) else path


def recipe_state_keys(path: Path) -> set[str]:
    """The (flattened) keys stored in a DCP recipe state, or a one-line error. Its ``.metadata``
    is read by ckptkit's restricted reader: one torch's own reader would run code from is refused."""
    if not holds_checkpoint(path):
        raise CkptkitError(
            f"{path}: no distributed recipe state there; set checkpointer.recipe_checkpoint to a checkpoint's "
            f"{RECIPE_STATE_DIR} folder"
        )
    return state_keys(path)


def load_recipe_state(path: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (sharded tensors are loaded in place, resharded to this world size).
    ``dcp.load`` unpickles ``.metadata`` as it is, so the restricted reader checks it first."""
    recipe_state_keys(path)
    try:
        dcp.load(state, checkpoint_id=path, planner=_PlainValuesPlanner())
    except Exception as e:  # DCP wraps per-rank failures; report the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CkptkitError(f"{path}: cannot load the recipe state ({first})") from None


class PeerFailed(CkptkitError):
    """A block failed on another rank: raised, with that rank's line, on the ranks where it
    did not (the failing rank prints the line; these exit without repeating it)."""


def one_line(error: BaseException) -> str:
    """What a failed rank tells the others: a CkptkitError's line, an OS error's file and
    reason, else the exception's type and first line."""
    if isinstance(error, CkptkitError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0]}" if first else type(error).__name__


@contextlib.contextmanager
def failing_together() -> Iterator[None]:
    """Every rank runs the block, then they compare outcomes (one collective): when it failed on
    some rank it fails on all, so that no rank waits in a later collective for one that left.
    A rank where it failed raises its error (an OS error as its one line); the others raise
    that rank's one line as a :class:`PeerFailed`."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:  # shared with the other ranks below, then raised
        error = e
    lines = gather_objects(None if error is None else one_line(error))
    if isinstance(error, OSError):
        raise CkptkitError(one_line(error)) from None
    if error is not None:
        raise error
    failed = next((line for line in lines if line is not None), None)
    if failed is not None:
        raise PeerFailed(failed)


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
