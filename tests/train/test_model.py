"""The native decoder against transformers' AutoModelForCausalLM on the tiny fixtures.

Measured on every family: max |logits difference| = 0.0 in float32 (and in bfloat16);
the asserted bound is ``TOL`` = 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from ckptkit.train import load_model
from ckptkit.train.attention import KVCache
from ckptkit.train.rope import rope_inv_freq

from train_helpers import FAMILIES, FIXTURES, TOL, fixture_config, hf_dir, hf_model, native_model, padded_batch


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_transformers(family: str) -> None:
    ids, mask = padded_batch(fixture_config(family).vocab_size)
    # transformers' forward numbers positions 0..T-1 even under left padding; generate()
    # (and ckptkit by default) count real tokens only, so pass those positions explicitly.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = native_model(family)(ids, attention_mask=mask)
        ref = hf_model(family)(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()  # padded positions' logits are meaningless in both
    assert (ours - ref).abs()[real].max().item() <= TOL


def _long_rope(family: str) -> tuple[dict, dict]:
    """Rope overrides so that one period of the slowest frequency fits in a short test.

    With the fixtures' theta (1e4..1e6) and head_dim 16/32 that period is 2*pi*theta^((d-2)/d)
    ~ 2e4..5e6 tokens. Plain rope: theta=100 (period 353 tokens at head_dim 16, 469 at 32).
    Llama 3 scaling: theta=10 and original_max_position_embeddings=32, so the frequencies
    fall in all three bands (kept, smoothed, divided by ``factor``); the slowest then has
    a period of ~188 * factor tokens (1507 for llama3_2's factor 32).
    """
    cfg = fixture_config(family)
    if cfg.rope_scaling:
        scaling = dict(cfg.rope_scaling, original_max_position_embeddings=32)
        return {"rope_theta": 10.0, "rope_scaling": scaling}, {
            "rope_theta": 10.0,
            "original_max_position_embeddings": 32,
        }
    return {"rope_theta": 100.0}, {"rope_theta": 100.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_longer_than_a_rope_period_matches_transformers(family: str) -> None:
    ours_cfg, hf_rope = _long_rope(family)
    model = native_model(family, **ours_cfg)
    period = 2 * math.pi / rope_inv_freq(model.config).min().item()
    seq = int(period) + 32
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - hf_model(family, **hf_rope)(ids).logits).abs().max().item()
    assert seq > period
    assert diff <= TOL


@pytest.mark.parametrize("family", ["llama3", "gemma", "qwen2"])
def test_bfloat16_matches_transformers(family: str) -> None:
    ids, mask = padded_batch(fixture_config(family).vocab_size, seed=3)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = native_model(family, torch.bfloat16)(ids, attention_mask=mask).float()
        ref = hf_model(family, torch.bfloat16)(ids, attention_mask=mask, position_ids=positions).logits.float()
    assert torch.equal(ours[mask.bool()], ref[mask.bool()])


@pytest.mark.parametrize(
    ("family", "ours", "theirs"),
    [
        ("mistral", {"sliding_window": 8}, {"sliding_window": 8}),
        # Qwen2 slides only from layer max_window_layers on.
        (
            "qwen2",
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
            {
                "sliding_window": 8,
                "use_sliding_window": True,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention"],
            },
        ),
    ],
)
def test_sliding_window_matches_transformers(family: str, ours: dict, theirs: dict) -> None:
    cfg = fixture_config(family)
    model = native_model(family, **ours)
    ref_model = hf_model(family, **theirs)
    ids, mask = padded_batch(cfg.vocab_size, seed=5)
    ids, mask = torch.cat([ids, ids], dim=1), torch.cat([mask, mask], dim=1)  # 24 tokens > window
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask, position_ids=positions).logits
        diff = (model(ids, attention_mask=mask) - ref).abs()
        full = (model(ids[:1]) - ref_model(ids[:1]).logits).abs().max().item()
    assert diff[mask.bool()].max().item() <= TOL
    assert full <= TOL


@pytest.mark.parametrize("family", ["llama3", "gemma", "deepseek_v3"])  # deepseek_v3: latents cached
def test_kv_cache_matches_full_forward(family: str) -> None:
    model = native_model(family)
    ids, mask = padded_batch(model.config.vocab_size, seed=7)
    ids, mask = ids[:2], mask[:2]  # full and left-padded rows
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = KVCache(model.config, 2, 12, "cpu", torch.float32)
        steps = [model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)]
        steps += [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache) for t in range(5, 12)]
    assert cache.length == 12
    incremental = torch.cat(steps, dim=1)
    assert (incremental - full).abs()[mask.bool()].max().item() <= TOL


def test_state_dict_uses_canonical_names() -> None:
    import ckptkit

    cfg, sd = ckptkit.load_checkpoint(str(hf_dir("qwen2")))
    assert set(native_model("qwen2").state_dict()) == set(sd)
    assert "output.weight" not in sd  # tied


def test_load_model_keeps_stored_dtype_and_matches_meta_checkpoint() -> None:
    meta = FIXTURES / "meta" / "llama2"
    model = load_model(str(hf_dir("llama2")))
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    from_meta = load_model(str(meta), dtype=torch.float32)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        assert torch.equal(from_meta(ids), native_model("llama2")(ids))


def test_backward_reaches_every_parameter() -> None:
    model = native_model("gemma").train()
    ids, mask = padded_batch(model.config.vocab_size)
    logits = model(ids, attention_mask=mask)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
