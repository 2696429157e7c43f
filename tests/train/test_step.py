"""Loss and optimizer: token-weighted accumulation, parity with the previous recipes, validation, compile."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckptkit.train.config import load_config
from ckptkit.train.data import DatasetConfig, build_dataset, collate
from ckptkit.train.recipes import recipe_entry
from ckptkit.train.schema import OptimizerConfig
from ckptkit.train.step import build_optimizer, forward_backward, summed_loss
from ckptkit.train.tokenizer import load_tokenizer

from conftest import FIXTURES
from train_helpers import native_model

MAIN_LOSSES = json.loads((Path(__file__).resolve().parents[1] / "data" / "main_losses.json").read_text())


def run(recipe: str, config: str, out: Path, *overrides: str) -> list[dict]:
    recipe_entry(recipe)(load_config(config, [*overrides, f"checkpointer.output_dir={out}", "quiet=true"]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def gradients(model: torch.nn.Module, batches: list[dict]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    forward_backward(model, batches, torch.device("cpu"))
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_four_micro_batches_of_one_equal_one_batch_of_four() -> None:
    """Samples of different lengths (so padding differs): the accumulated gradient is the big batch's."""
    data = build_dataset(DatasetConfig(source="tiny_alpaca"), load_tokenizer(FIXTURES / "hf" / "llama2"))
    samples = [data[i] for i in (0, 8, 20, 40)]
    assert len({len(s.ids) for s in samples}) > 1
    model = native_model("llama2").train()
    big = gradients(model, [collate(samples, 0)])
    small = gradients(model, [collate([s], 0) for s in samples])
    scale = max(g.abs().max().item() for g in big.values())
    worst = max((big[n] - small[n]).abs().max().item() for n in big)
    assert worst <= 1e-6 * scale  # float32 summation order only
    # the previous rule (mean of per-micro-batch means) is measurably different on these samples
    model.zero_grad(set_to_none=True)
    for s in samples:
        b = collate([s], 0)
        logits = model(b["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        (loss / 4).backward()
    assert max((big[n] - p.grad).abs().max().item() for n, p in model.named_parameters()) > 100 * worst


def test_recipe_accumulation_logs_the_big_batch_loss(tmp_path: Path) -> None:
    one = ["epochs=1", "max_steps_per_epoch=1", "checkpointer.checkpoint_dir=fixtures/hf/llama2"]
    big = run("full_finetune", "tiny_full", tmp_path / "big", *one, "batch_size=4")
    acc = run("full_finetune", "tiny_full", tmp_path / "acc", *one, "batch_size=1", "gradient_accumulation_steps=4")
    (big_loss,), (acc_loss,) = ([r["loss"] for r in rows if "loss" in r] for rows in (big, acc))
    assert abs(big_loss - acc_loss) <= 1e-6 * big_loss


@pytest.mark.parametrize("case", [k for k in MAIN_LOSSES if not k.startswith("_")])
def test_losses_equal_the_previous_recipes(case: str, tmp_path: Path) -> None:
    """Where issue 10 changed no semantics: the first steps' losses equal the recorded ones to 1e-5
    (relative), with the unfused optimizer and, for the short runs, the fused one.

    The record was made on another CPU: its kernels round the last bit differently (measured
    on an AMD EPYC here: 2.7e-6 relative at most over the first 4 steps of every case, then
    amplified by lr 2e-2 to 1e-2 by step 22 of ``tiny_lora_text``), so only the steps before
    that amplification are compared; a change of semantics moves the first steps by far more.
    """
    spec = MAIN_LOSSES[case]
    loop = run(spec["recipe"], spec["config"], tmp_path / "loop", *spec["overrides"], "optimizer.fused=false")
    got = [r["loss"] for r in loop if "loss" in r]
    assert len(got) == len(spec["losses"])
    assert max(abs(a - b) / b for a, b in zip(got[:4], spec["losses"][:4], strict=True)) < 1e-5
    if case.endswith("llama3"):  # short runs; longer runs at lr 2e-2 amplify last-bit differences
        fused = run(spec["recipe"], spec["config"], tmp_path / "fused", *spec["overrides"])
        got = [r["loss"] for r in fused if "loss" in r]
        assert max(abs(a - b) / b for a, b in zip(got[:4], spec["losses"][:4], strict=True)) < 1e-5


def test_fused_adamw_on_cpu_and_cuda() -> None:
    """Fused by default on CPU and CUDA (the devices torch fuses AdamW on; the parameters
    can stay on the CPU: construction only records the choice), torch's choice elsewhere."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    for device in ("cpu", "cuda"):
        assert build_optimizer(params, OptimizerConfig(), torch.device(device)).defaults["fused"] is True, device
    assert not build_optimizer(params, OptimizerConfig(), torch.device("meta")).defaults["fused"]
    unfused = build_optimizer(params, OptimizerConfig(fused=False), torch.device("cpu")).defaults
    assert not unfused["fused"] and unfused["foreach"] is None  # torch's choice: for-loop on CPU
    # the section's settings reach AdamW: two steps move the weights as torch's own for-loop AdamW does
    settings = OptimizerConfig(lr=1e-2, betas=[0.8, 0.95], weight_decay=0.1)
    start = torch.linspace(-1, 1, 64)
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizers = [build_optimizer([ours], settings, torch.device("cpu")),
                  torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)]  # fmt: skip
    for step in range(2):
        for w, opt in zip((ours, ref), optimizers, strict=True):
            w.grad = torch.cos(torch.arange(64.0) + step)
            opt.step()
    eps = torch.finfo(torch.float32).eps
    assert not torch.equal(ref.detach(), start)
    assert torch.allclose(ours, ref, rtol=4 * eps, atol=4 * eps)  # fused vs for-loop: a few float32 ulps


def test_validation_loss_is_logged(tmp_path: Path) -> None:
    rows = run("lora_finetune", "tiny_lora", tmp_path, "epochs=2", "dataset.validation_fraction=0.25",
               "eval_every_n_steps=2", "checkpointer.checkpoint_dir=fixtures/hf/llama3")  # fmt: skip
    train_steps = [r["step"] for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert len(train_steps) == 8  # 36 training rows / batch 8 = 4 steps per epoch
    assert [s for s, _ in evals] == [2, 4, 6, 8]
    assert evals[-1][1] < evals[0][1]


@pytest.mark.slow
def test_compiled_layers_give_the_same_gradients() -> None:
    """Dynamo captures the blocks' graphs, and the gradients are eager's to a few float32
    ulps of each tensor's largest gradient (the compiled kernels fuse and reorder; measured 4)."""
    from torch._dynamo.utils import counters

    from ckptkit.train.step import compile_layers

    batch = collate(
        build_dataset(DatasetConfig(source="tiny_alpaca"), load_tokenizer(FIXTURES / "hf" / "llama3")).samples[:2], 0
    )
    eager = gradients(native_model("llama3").train(), [batch])
    model = native_model("llama3").train()
    counters.clear()
    compile_layers(model)
    compiled = gradients(model, [batch])
    assert counters["frames"]["ok"] >= 1 and counters["stats"]["calls_captured"] > 0  # torch.compile ran
    assert list(compiled) == list(eager)  # parameter names unchanged
    eps = torch.finfo(torch.float32).eps
    for n, g in eager.items():
        assert (g - compiled[n]).abs().max().item() <= 16 * eps * g.abs().max().item(), n


def test_schedule_is_torch_linear_warmup_then_cosine_to_the_floor() -> None:
    """LambdaLR's factors are those of torch's LinearLR (warmup) followed by CosineAnnealingLR
    down to ``lr * min_lr_ratio`` at ``total_steps``; after that the rate stays at the floor."""
    from ckptkit.train.schema import SchedulerConfig
    from ckptkit.train.step import build_scheduler

    for warmup, total in [(3, 12), (2, 3), (0, 5), (4, 4)]:
        ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        sched = build_scheduler(ours, SchedulerConfig(warmup_steps=warmup, min_lr_ratio=0.1), total)
        ref = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        parts = [torch.optim.lr_scheduler.LinearLR(ref, 1 / (warmup + 1), 1.0, total_iters=warmup)] if warmup else []
        parts.append(torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=max(total - warmup, 1), eta_min=0.2))
        chained = torch.optim.lr_scheduler.SequentialLR(ref, parts, milestones=[warmup]) if warmup else parts[0]
        for step in range(total + 4):
            got, want = ours.param_groups[0]["lr"], ref.param_groups[0]["lr"]
            if step > total:
                want = 0.2  # torch's cosine climbs back after T_max; the schedule stays at the floor
            assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), (warmup, total, step, got, want)
            ours.step(), sched.step(), ref.step(), chained.step()


def _batch(family: str, n: int) -> dict[str, torch.Tensor]:
    return collate(
        build_dataset(DatasetConfig(source="tiny_alpaca"), load_tokenizer(FIXTURES / "hf" / family)).samples[:n], 0
    )


def test_forward_backward_counts_tokens_and_scales_by_the_ranks() -> None:
    """The step's loss is the label tokens' mean cross-entropy (as F.cross_entropy computes it),
    its counts are the batch's, the total goes through ``reduce``, and ``world_size`` ranks
    scale the gradient by exactly that factor (FSDP then averages it back)."""
    batch = _batch("llama2", 3)
    model = native_model("llama2").train()
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    mean = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()
    one = gradients(model, [batch])
    reduced: list[torch.Tensor] = []
    model.zero_grad(set_to_none=True)
    stats = forward_backward(model, [batch], torch.device("cpu"), world_size=2, reduce=reduced.append)
    assert math.isclose(stats.loss, mean, rel_tol=8 * torch.finfo(torch.float32).eps)
    assert stats.label_tokens == int((batch["labels"] != -100).sum()) and stats.label_tokens > 0
    assert stats.input_tokens == int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    assert len(reduced) == 1 and math.isclose(reduced[0].item(), mean * stats.label_tokens, rel_tol=1e-6)
    assert all(torch.equal(p.grad, 2 * one[n]) for n, p in model.named_parameters())  # exact: a power of two


def test_a_step_of_one_label_token_is_that_token_s_loss() -> None:
    batch = _batch("llama2", 1)
    keep = int((batch["labels"][0] != -100).nonzero()[0])
    batch["labels"] = torch.full_like(batch["labels"], -100)
    batch["labels"][0, keep] = batch["input_ids"][0, keep + 1]
    model = native_model("llama2")
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    expected = F.cross_entropy(logits[0, keep][None], batch["labels"][0, keep][None]).item()
    stats = forward_backward(model, [batch], torch.device("cpu"))
    assert stats.label_tokens == 1 and math.isclose(stats.loss, expected, rel_tol=8 * torch.finfo(torch.float32).eps)


def test_a_packed_batch_s_loss_is_the_sum_of_its_documents_losses() -> None:
    """Documents packed into one row attend only within themselves, from position 0."""
    tokenizer = load_tokenizer(FIXTURES / "hf" / "llama2")
    packed = build_dataset(DatasetConfig(source="tiny_alpaca", packed=True, max_seq_len=256), tokenizer).samples[:1]
    plain = build_dataset(DatasetConfig(source="tiny_alpaca"), tokenizer).samples[: len(packed[0].lengths)]
    assert len(plain) > 1
    model = native_model("llama2")
    with torch.no_grad():
        together = summed_loss(model, collate(packed, 0)).item()
        apart = sum(summed_loss(model, collate([s], 0)).item() for s in plain)
    assert math.isclose(together, apart, rel_tol=1e-5)  # float32 sums of ~1e3 terms in another order


def test_compile_layers_compiles_every_block() -> None:
    """``torch.compile`` marks each block (it compiles lazily, on the first call)."""
    from ckptkit.train.step import compile_layers, compiled_layers

    model = native_model("llama3")
    assert compiled_layers(model) == 0
    compile_layers(model)
    blocks = list(model.layers)
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert compiled_layers(model) == 2


def test_a_left_padded_row_s_loss_is_its_loss_without_the_padding() -> None:
    """The padding mask reaches the model: tokens after left padding attend to none of it."""
    from train_helpers import padded_batch

    model = native_model("llama2")
    ids, mask = padded_batch(model.config.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    with torch.no_grad():
        padded = summed_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}).item()
        rows = [
            {"input_ids": ids[r, keep][None], "attention_mask": mask[r, keep][None], "labels": labels[r, keep][None]}
            for r, keep in enumerate(mask.bool())
        ]
        apart = sum(summed_loss(model, row).item() for row in rows)
    assert math.isclose(padded, apart, rel_tol=1e-6)  # float32 sums of ~30 terms in another order
