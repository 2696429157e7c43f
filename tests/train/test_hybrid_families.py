"""The native decoder on Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet linear attention
interleaved with gated full attention, partial rope, a shared expert behind a sigmoid gate):
logits as transformers' eager float32 ones over two 64-token chunks of the delta rule, padded
rows as transformers masks them, every token routed to transformers' experts (ties included),
greedy generation from the cache (convolution inputs and recurrent state) as transformers'."""

from __future__ import annotations

import pytest
import torch

from train_helpers import hf_model, native_model

NAMES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-vl"]
# Max |logits difference| measured against transformers' eager attention (float32), 70 tokens:
# 1.5e-6 (qwen3_next, qwen3_5-vl), 7.5e-7 (qwen3_5), 7.3e-7 (qwen3_5_moe); the chunked delta rule
# is the same arithmetic, full attention is SDPA against eager's matmul-softmax-matmul.
PARITY = 2e-6


def _ids(seed: int, length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 384, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_native_logits_match_transformers_across_chunks(name: str) -> None:
    ours, theirs = native_model(name), hf_model(name)
    ids = _ids(0, 70)  # the delta rule's chunks are 64 tokens: the second starts from the first's state
    with torch.no_grad():
        want = theirs(ids).logits
        assert (ours(ids) - want).abs().max().item() <= PARITY


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_padded_rows_match_transformers(name: str) -> None:
    """Left- and right-padded rows: padded tokens zeroed at the linear layers' input, masked in
    full attention; the real tokens' logits are transformers'."""
    ids = _ids(1, 12, 3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, 9:] = 0
    ours, theirs = native_model(name), hf_model(name)
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() <= PARITY
    alone = ours(ids[1:2, 5:])  # the left-padded row without its padding
    assert (got[1, 5:] - alone[0]).abs().max().item() <= PARITY


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_routing_is_transformers_with_ties(name: str) -> None:
    """In the first MoE layer the router is zero (every expert ties, torch.topk's order
    decides); the others route by their weights. Each token goes to transformers' experts,
    in its order, and the shared expert's gate scales its output."""
    from ckptkit.train.experts import SparseMoE

    ours, theirs = native_model(name), hf_model(name)
    moe = [layer.mlp for layer in ours.layers if isinstance(layer.mlp, SparseMoE)]
    gates = [layer.mlp.gate for layer in theirs.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe) == len(gates) >= 2 and all(m.shared_gate is not None for m in moe)
    routed: list[torch.Tensor] = []
    with torch.no_grad():
        moe[0].router.weight.zero_()
        gates[0].weight.zero_()
        for gate in gates:
            gate.register_forward_hook(lambda _m, _a, out: routed.append(out[2]))  # (logits, weights, indices)
        ids = _ids(2, 24)
        want = theirs(ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= PARITY
    assert len({tuple(row) for row in moe[0].chosen.tolist()}) == 1  # all tied: one choice for every token
    for mine, theirs_chosen in zip(moe, routed, strict=True):
        assert torch.equal(mine.chosen, theirs_chosen)
    assert len(set(moe[1].chosen.flatten().tolist())) == 4


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_greedy_from_the_cache_matches_transformers_generate(name: str) -> None:
    """Two rows, one left-padded: the prompt through the chunked rule, then one token at a time
    from the cached convolution inputs and recurrent state, as transformers generates."""
    from ckptkit.train.generation import generate

    ids = _ids(3, 9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ours = generate(native_model(name), ids, 12, attention_mask=mask)
    ref = hf_model(name).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(ours, ref)


def test_the_gated_norm_gates_the_linear_layer() -> None:
    """The linear layer's output is ``norm(y) * silu(z)``: with z zero it adds nothing."""
    model = native_model("qwen3_5")
    ids = _ids(4, 10)
    with torch.no_grad():
        before = model(ids)
        model.layers[0].linear_attn.in_proj_z.weight.zero_()  # silu(0) = 0: the layer adds nothing
        zeroed = model(ids)
        model.layers[0].linear_attn.out_proj.weight.zero_()
        assert torch.equal(zeroed, model(ids)) and not torch.allclose(before, zeroed)
