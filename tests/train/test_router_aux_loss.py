"""The router's load-balancing loss of mixture-of-experts models in training: transformers'
``load_balancing_loss_func`` (padding left out), added to the loss with the config's weight
as transformers' causal-LM loss adds it, and summed over ranks to the whole batch's value."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.train.moe_loss import load_balancing_loss
from ckptkit.train.samples import IGNORE_INDEX
from ckptkit.train.step import forward_backward, router_aux_weight

from train_helpers import fixture_config, hf_model, native_model

MOE = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe"}


def _reference(family: str):  # transformers' own function
    return importlib.import_module(f"transformers.models.{MOE[family]}.modeling_{MOE[family]}").load_balancing_loss_func


def right_padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens, right-padded by 0, 4 and 7 (positions as transformers counts them)."""
    ids = torch.randint(3, 384, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", list(MOE))
def test_aux_loss_with_padding_equals_transformers(family: str) -> None:
    ids, mask = right_padded()
    cfg = fixture_config(family)
    with torch.no_grad():
        logits = hf_model(family)(ids, attention_mask=mask, output_router_logits=True).router_logits
    n, k = cfg.extra.num_experts, cfg.extra.num_experts_per_tok
    want = _reference(family)(logits, n, k, mask)
    got = load_balancing_loss(logits, n, k, mask)
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    unmasked = _reference(family)(logits, n, k)
    assert abs(load_balancing_loss(logits, n, k).item() - unmasked.item()) <= 1e-6
    assert abs(unmasked.item() - want.item()) > 1e-4  # the mask matters on this batch


@pytest.mark.parametrize("family", list(MOE))
def test_training_loss_and_gradients_equal_transformers_causal_lm_loss(family: str) -> None:
    # transformers: mean cross-entropy + router_aux_loss_coef * aux (output_router_logits=True).
    ids, mask = right_padded(1)
    coef = 0.25  # larger than config.json's 0.001, so that a wrong aux term shows
    ref = hf_model(family)
    ref.config.router_aux_loss_coef = ref.router_aux_loss_coef = coef
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    out = ref(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()

    model = native_model(family).train()
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]  # collated batches carry labels already shifted
    batch = {"input_ids": ids, "attention_mask": mask, "labels": shifted}
    stats = forward_backward(model, [batch], torch.device("cpu"), aux_weight=coef)
    assert abs(stats.loss - out.loss.item()) <= 1e-5 * out.loss.item()
    assert stats.aux_loss is not None and abs(stats.aux_loss - out.aux_loss.item()) <= 1e-5
    for layer in (layer for layer in (0, 2) if hasattr(model.layers[layer].mlp, "router")):  # qwen3_next: 0 dense
        ours = model.layers[layer].mlp.router.weight.grad
        theirs = ref.model.layers[layer].mlp.gate.weight.grad
        assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()
    if hasattr(model.layers[0], "linear_attn"):  # Gated DeltaNet's backward: its decay rates' and conv's gradients
        for name in ("A_log", "dt_bias", "conv1d.weight"):
            ours, theirs = (m.layers[0].linear_attn.get_parameter(name).grad for m in (model, ref.model))
            assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


def test_aux_weight_comes_from_config_json_unless_the_recipe_sets_it() -> None:
    cfg = fixture_config("mixtral")
    assert router_aux_weight(None, cfg) == 0.001  # fixtures/hf/mixtral/config.json
    assert router_aux_weight(0.02, cfg) == 0.02 and router_aux_weight(0.0, cfg) == 0.0
    assert router_aux_weight(None, cfg.replace_fields(router_aux_loss_coef=0.5)) == 0.5
    assert router_aux_weight(None, fixture_config("qwen3")) == 0.0  # no experts, no aux loss
    with pytest.raises(CkptkitError, match=r"^router_aux_loss_coef applies to mixture-of-experts models; qwen3 has no"):
        router_aux_weight(0.02, fixture_config("qwen3"))


def test_aux_weight_zero_trains_on_cross_entropy_alone() -> None:
    ids, mask = right_padded(2)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids.masked_fill(mask == 0, IGNORE_INDEX)[:, 1:]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    plain = forward_backward(native_model("qwen3_moe").train(), [batch], torch.device("cpu"))
    weighted = forward_backward(native_model("qwen3_moe").train(), [batch], torch.device("cpu"), aux_weight=0.5)
    assert plain.aux_loss is None and weighted.aux_loss is not None
    assert abs(weighted.loss - plain.loss - 0.5 * weighted.aux_loss) <= 1e-6 * weighted.loss


def test_aux_loss_summed_over_ranks_is_the_whole_batch_loss_and_gradient() -> None:
    # Two "ranks" holding halves of a batch: with a reduce that adds the other half's sums,
    # each computes the whole batch's value, and their gradients add up to the whole one's.
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn(10, 4, generator=gen, requires_grad=True) for _ in range(3)]
    mask = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1, 0, 0])
    whole = load_balancing_loss(layers, 4, 2, mask)
    whole_grads = torch.autograd.grad(whole, layers)
    halves = [[x[:5] for x in layers], [x[5:] for x in layers]]
    masks = [mask[:5], mask[5:]]
    sums = [{}, {}]
    for r in (0, 1):  # each rank's own sums, as the reduce sees them
        load_balancing_loss(halves[r], 4, 2, masks[r], reduce=lambda t, r=r: sums[r].setdefault("t", t.clone()))
    total = [torch.zeros(10, 4) for _ in layers]
    for r in (0, 1):
        value = load_balancing_loss(halves[r], 4, 2, masks[r], reduce=lambda t, r=r: t.add_(sums[1 - r]["t"]))
        assert abs(value.item() - whole.item()) <= 1e-6
        for g, x in zip(total, torch.autograd.grad(value, layers), strict=True):
            g += x
    for g, w in zip(total, whole_grads, strict=True):
        assert torch.allclose(g, w, atol=1e-7)


def test_two_micro_batches_average_the_aux_loss_and_its_gradient() -> None:
    """A step of two micro-batches: the aux loss is the mean of each one's, the cross-entropy
    the token mean over both, and the gradient the matching mix of single-batch gradients."""

    def batch(seed: int) -> dict[str, torch.Tensor]:
        ids, mask = right_padded(seed)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids.masked_fill(mask == 0, IGNORE_INDEX)[:, 1:]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def step(batches: list[dict[str, torch.Tensor]], weight: float):
        model = native_model("qwen3_moe").train()
        stats = forward_backward(model, batches, torch.device("cpu"), aux_weight=weight)
        return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    w, batches = 0.5, [batch(4), batch(5)]
    both, grads = step(batches, w)
    single = [step([b], w) for b in batches]
    plain = [step([b], 0.0) for b in batches]  # cross-entropy alone
    tokens = [s.label_tokens for s, _ in single]
    assert both.label_tokens == sum(tokens)
    assert both.input_tokens == sum(int(b["attention_mask"].sum()) for b in batches)
    aux = sum(s.aux_loss for s, _ in single) / 2
    assert both.aux_loss is not None and math.isclose(both.aux_loss, aux, rel_tol=1e-6)
    ce = sum(p.loss * t for (p, _), t in zip(plain, tokens, strict=True)) / sum(tokens)
    assert math.isclose(both.loss, ce + w * aux, rel_tol=1e-6)
    for name, g in grads.items():  # d(ce)/T-weighted, plus half of each batch's aux gradient
        expected = sum(
            (t / sum(tokens)) * p[name] + (s[name] - p[name]) / 2
            for (_, p), (_, s), t in zip(plain, single, tokens, strict=True)
        )
        assert torch.allclose(g, expected, rtol=1e-4, atol=1e-6), name


def test_two_ranks_with_halves_of_a_batch_report_the_whole_batch_s_losses() -> None:
    """``reduce`` (a sum over ranks) reaches the aux loss's sums as well as the loss: each of two
    "ranks" holding half a batch reports the loss and aux loss of the whole batch."""
    ids, mask = right_padded(6)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids.masked_fill(mask == 0, IGNORE_INDEX)[:, 1:]
    whole = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    halves = [{k: v[:2] for k, v in whole.items()}, {k: v[2:] for k, v in whole.items()}]
    tokens = int((labels != IGNORE_INDEX).sum())
    expected = forward_backward(native_model("qwen3_moe").train(), [whole], torch.device("cpu"), aux_weight=0.5)
    seen: list[list[torch.Tensor]] = [[], []]
    for r in (0, 1):  # what each rank's reduce is given, in order
        forward_backward(native_model("qwen3_moe").train(), [halves[r]], torch.device("cpu"), tokens, 2,
                         lambda t, r=r: seen[r].append(t.detach().clone()), 0.5)  # fmt: skip
    for r in (0, 1):
        calls = iter(seen[1 - r])
        got = forward_backward(native_model("qwen3_moe").train(), [halves[r]], torch.device("cpu"), tokens, 2,
                               lambda t, calls=calls: t.add_(next(calls)), 0.5)  # fmt: skip
        assert got.aux_loss is not None and expected.aux_loss is not None
        assert math.isclose(got.aux_loss, expected.aux_loss, rel_tol=1e-5)
        assert math.isclose(got.loss, expected.loss, rel_tol=1e-5)
