"""Activation offloading: saved activations leave memory in forward and come back bit for
bit in backward (CPU: files on disk; CUDA: pinned host memory on a side stream)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from test_recipes import losses, run
from torch.utils.checkpoint import checkpoint

from ckptkit.errors import CkptkitError
from ckptkit.train import offload as offload_mod
from ckptkit.train.offload import ActivationOffload
from ckptkit.train.step import summed_loss

from conftest import tree_hashes
from train_helpers import native_model


def _batch(vocab: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.roll(ids, -1, 1)}


def _trained(
    checkpointed: bool, folder: Path | None, device: str = "cpu"
) -> tuple[dict, int, int, ActivationOffload | None]:
    """(gradients, layer outputs still alive after forward, layers, the offloader) of one step."""
    model = native_model("llama3").train().to(device)
    if checkpointed:
        for layer in model.layers:
            layer.forward = lambda *a, f=layer.forward: checkpoint(f, *a, use_reentrant=False)
    off = None
    if folder is not None:
        off = ActivationOffload(torch.device(device), folder, min_bytes=1024)
        off.wrap(model)
    outputs: list[weakref.ref] = []
    for layer in model.layers:
        layer.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    loss = summed_loss(model, _batch(model.config.vocab_size, device))
    alive = sum(r() is not None for r in outputs)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, alive, len(outputs), off


@pytest.mark.parametrize("checkpointed", [True, False])
def test_offloaded_activations_free_memory_and_give_the_same_gradients(checkpointed: bool, tmp_path: Path) -> None:
    plain, alive, layers, _ = _trained(checkpointed, None)
    assert layers == 2 and alive == layers  # autograd keeps each layer's output (the next one's input)
    moved, alive, _, off = _trained(checkpointed, tmp_path / "acts")
    assert alive == 0  # only the copies on disk hold them now
    assert off is not None and off.moved_bytes >= layers * 2 * 64 * native_model("llama3").config.hidden_size * 4
    assert list((tmp_path / "acts").iterdir()) == []  # each file goes when backward has read it
    assert all(torch.equal(moved[n], plain[n]) for n in plain)  # bitwise
    off.close()
    assert not (tmp_path / "acts").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory path needs CUDA")
def test_offloading_to_pinned_host_memory_gives_the_same_gradients() -> None:
    plain, _, _, _ = _trained(True, None, "cuda")
    moved, alive, _, off = _trained(True, Path("unused"), "cuda")
    assert alive == 0 and off is not None and off.moved_bytes > 0
    assert all(torch.equal(moved[n], plain[n]) for n in plain)


def test_layouts_dtypes_sharing_and_what_stays(tmp_path: Path) -> None:
    """Strides of dense tensors kept, others made contiguous; a tensor saved twice moved once;
    parameters, their views and small tensors left in place."""
    off = ActivationOffload(torch.device("cpu"), tmp_path, min_bytes=64)
    base = torch.arange(24 * 8, dtype=torch.float32).view(24, 8)
    for t in (base, base.t(), base[::2], base.to(torch.bfloat16).t(), base[3:5]):
        got = offload_mod._unpack(off.pack(t))
        assert got.dtype == t.dtype and torch.equal(got, t) and got.data_ptr() != t.data_ptr()
        assert got.stride() == (t.stride() if offload_mod._dense(t) else t.contiguous().stride())
    off._seen.clear()
    before = off.moved_bytes
    assert off.pack(base) is off.pack(base)
    assert off.moved_bytes - before == base.numel() * 4
    weight = torch.nn.Parameter(torch.ones(16, 16))
    for t in (weight, weight.t(), torch.ones(4)):
        assert off.pack(t) is t


def test_a_recipe_with_offloading_trains_as_without(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``enable_activation_offloading`` with activation checkpointing: the same losses and
    weights, activations on disk in the output folder while it runs, none left after."""
    monkeypatch.setattr(offload_mod, "MIN_BYTES", 1024)  # the tiny model's activations are small
    written: list[int] = []
    init = offload_mod._OnDisk.__init__

    def counted(self: offload_mod._OnDisk, t: torch.Tensor, folder: Path) -> None:
        assert folder.parent == tmp_path / "off"
        init(self, t, folder)
        written.append(self.nbytes)

    monkeypatch.setattr(offload_mod._OnDisk, "__init__", counted)
    one = ["epochs=1", "max_steps_per_epoch=1", "enable_activation_checkpointing=true"]
    run("full_finetune", "tiny_full", *one, f"checkpointer.output_dir={tmp_path / 'ac'}")
    assert written == []
    run("full_finetune", "tiny_full", *one, "enable_activation_offloading=true",
        f"checkpointer.output_dir={tmp_path / 'off'}")  # fmt: skip
    assert written and losses(tmp_path / "ac") == losses(tmp_path / "off")
    assert tree_hashes(tmp_path / "ac" / "epoch_0") == tree_hashes(tmp_path / "off" / "epoch_0")
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == sorted(p.name for p in (tmp_path / "ac").iterdir())


def test_offloading_refuses_a_device_it_cannot_use() -> None:
    with pytest.raises(CkptkitError, match="^enable_activation_offloading runs on cpu or cuda, not meta$"):
        ActivationOffload(torch.device("meta"))
