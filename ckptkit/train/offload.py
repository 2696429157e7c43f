"""Activation offloading: the tensors autograd keeps for backward moved off the compute
device's memory during forward and brought back when backward needs them.

On CUDA each one is copied to pinned CPU memory on a side stream (non-blocking; the
compute stream goes on) and copied back on the compute stream, after that copy, in
backward. On CPU there is no slower memory beside RAM: each one is written to a file in a
folder on disk and read back in backward, which trades disk traffic for RAM. Either way
the values come back bit for bit, so gradients are those of a run without offloading.

With activation checkpointing what autograd keeps is little more than each decoder
layer's input, so offloading takes the activations' memory down to about one layer's.
Parameters (also views of them), tensors under ``min_bytes`` and tensor subclasses (an
NF4 base) stay where they are; a tensor saved by several operations in one forward (the
rope tables and mask every layer takes) is moved once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptkit.errors import CkptkitError

MIN_BYTES = 1 << 20
"""Smaller saved tensors stay where they are (moving them costs more than they hold)."""


class _OnDisk:
    """A tensor's bytes in a file (removed when this handle is dropped), its layout kept."""

    def __init__(self, t: torch.Tensor, folder: Path) -> None:
        t = t.detach() if _dense(t) else t.detach().contiguous()  # a dense layout is kept as it is
        self.size, self.stride, self.dtype = t.size(), t.stride(), t.dtype
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())  # exactly its elements' memory
        fd, self.path = tempfile.mkstemp(dir=folder, suffix=".act")
        with os.fdopen(fd, "wb") as f:
            f.write(flat.view(torch.uint8).numpy().data)
        self.nbytes = flat.numel() * flat.element_size()
        weakref.finalize(self, _unlink, self.path)

    def get(self) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.readinto(buf.numpy().data)
        return buf.view(self.dtype).as_strided(self.size, self.stride)


class _OnHost:
    """A CUDA tensor copied to pinned CPU memory on ``stream``; back on the compute stream."""

    def __init__(self, t: torch.Tensor, stream: Any) -> None:
        self.device = t.device
        self.host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
            self.done = torch.cuda.Event()
            self.done.record(stream)

    def get(self) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return self.host.to(self.device, non_blocking=True)


class ActivationOffload:
    """Saved-tensor hooks moving activations to pinned CPU memory (CUDA) or to files in
    ``folder`` (CPU; made at first use, removed by :meth:`close`; None: a temporary folder);
    :meth:`wrap` applies them to every call of a module's forward."""

    def __init__(self, device: torch.device, folder: Path | None = None, min_bytes: int | None = None) -> None:
        if device.type not in ("cpu", "cuda"):
            raise CkptkitError(f"enable_activation_offloading runs on cpu or cuda, not {device.type}")
        self.device, self.min_bytes = device, MIN_BYTES if min_bytes is None else min_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.folder = folder
        self._made: Path | None = None
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]] = {}
        self.moved_bytes = 0
        """Bytes moved since construction (a tensor saved twice in one forward counts once)."""

    def wrap(self, module: nn.Module) -> None:
        """Run every ``module`` forward under these hooks (the loss and backward need nothing)."""
        module.forward = partial(self._call, module.forward)

    def _call(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._seen.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
                return forward(*args, **kwargs)
        finally:
            self._seen.clear()  # one forward's tensors: ids are reused after

    def pack(self, t: torch.Tensor) -> Any:
        """What autograd keeps instead of ``t``: ``t`` itself, or a handle to its moved copy."""
        if (
            type(t) is not torch.Tensor
            or isinstance(t, nn.Parameter)
            or isinstance(t._base, nn.Parameter)
            or t.device.type != self.device.type
            or t.numel() * t.element_size() < self.min_bytes
        ):
            return t
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        handle = _OnHost(t, self.stream) if self.stream is not None else _OnDisk(t, self._files())
        self._seen[id(t)] = (weakref.ref(t), t._version, handle)
        self.moved_bytes += t.numel() * t.element_size()
        return handle

    def _files(self) -> Path:
        """The CPU path's folder, made at first use (``folder``, else a new temporary one)."""
        if self._made is None:
            if self.folder is None:
                self._made = Path(tempfile.mkdtemp(prefix="ckptkit-activations-"))
            else:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._made = self.folder
        return self._made

    def close(self) -> None:
        """Remove the CPU path's folder (files of a forward never backpropagated included)."""
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            self._made = None


def _unpack(packed: Any) -> torch.Tensor:
    return packed.get() if isinstance(packed, _OnDisk | _OnHost) else packed


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free stretch of memory, each once (any dim order)."""
    expected = 1
    for size, stride in sorted(zip(t.size(), t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
