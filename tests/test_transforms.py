"""Every transform's inverse restores its input bitwise, for random shapes and dtypes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.tensors.transforms import COPY, FUSED, RANKS, ROPE_K, ROPE_Q, Transform


def rope_meta_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    return ROPE_Q.forward(w, SimpleNamespace(num_heads=heads), [tuple(w.shape)])[0]


def rope_hf_to_meta(w: torch.Tensor, heads: int) -> torch.Tensor:
    return ROPE_Q.inverse([w], SimpleNamespace(num_heads=heads))


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 8), half=st.integers(1, 8), cols=st.integers(0, 9), dtype=DTYPES, seed=st.integers(0, 999))
def test_rope_permutation_inverts(heads: int, half: int, cols: int, dtype: torch.dtype, seed: int) -> None:
    shape = (heads * half * 2, cols) if cols else (heads * half * 2,)  # weights and biases
    w = _random(shape, dtype, seed)
    assert _bitwise(rope_hf_to_meta(rope_meta_to_hf(w, heads), heads), w)
    assert _bitwise(rope_meta_to_hf(rope_hf_to_meta(w, heads), heads), w)


def test_rope_permutation_matches_the_reference_formula() -> None:
    # transformers' convert_llama_weights_to_hf: w.view(n, hd // 2, 2, dim).transpose(1, 2)
    n, hd, dim = 4, 8, 6
    w = torch.arange(n * hd * dim, dtype=torch.float32).reshape(n * hd, dim)
    reference = w.view(n, hd // 2, 2, dim).transpose(1, 2).reshape(n * hd, dim)
    assert torch.equal(rope_meta_to_hf(w, n), reference)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    cols=st.integers(1, 7),
    dtype=DTYPES,
    seed=st.integers(0, 999),
)
def test_fused_split_inverts(sizes: list[int], cols: int, dtype: torch.dtype, seed: int) -> None:
    w = _random((sum(sizes), cols), dtype, seed)
    shapes = FUSED.part_shapes(tuple(w.shape), [(n, cols) for n in sizes])
    parts = FUSED.forward(w, None, shapes)
    assert [p.shape[0] for p in parts] == sizes
    assert _bitwise(FUSED.inverse(parts, None), w)
    assert FUSED.native_shape(shapes) == tuple(w.shape)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(1, 8),
    rows=st.integers(1, 5),
    cols=st.integers(1, 5),
    dim=st.sampled_from([0, 1, None]),
    dtype=DTYPES,
    seed=st.integers(0, 999),
)
def test_rank_split_inverts(ranks: int, rows: int, cols: int, dim: int | None, dtype: torch.dtype, seed: int) -> None:
    shape = (rows * (ranks if dim == 0 else 1), cols * (ranks if dim == 1 else 1))
    w = _random(shape, dtype, seed)
    parts = RANKS.inverse(w, ranks, dim)
    assert len(parts) == ranks
    assert all(tuple(p.shape) == RANKS.shard_shape(tuple(w.shape), ranks, dim) for p in parts)
    assert _bitwise(RANKS.forward(parts, dim), w)


def test_rope_k_uses_the_kv_head_count() -> None:
    # GQA: k has num_kv_heads heads; permuting by num_heads would scramble it.
    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2)
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    reference = w.view(2, 4, 2, 3).transpose(1, 2).reshape(16, 3)
    assert torch.equal(ROPE_K.forward(w, cfg, [(16, 3)])[0], reference)
    assert torch.equal(ROPE_K.inverse([reference], cfg), w)


class _Transpose(Transform):
    """A kind added the documented way: forward and inverse only."""

    def forward(self, native, cfg, shapes):
        return [native.t().contiguous()]

    def inverse(self, parts, cfg):
        return parts[0].t().contiguous()


def test_new_kind_without_span_maps_goes_through_memory() -> None:
    # Inheriting the identity's span maps would copy untransposed bytes; it must get none.
    spans = [("f", 0, 24)]
    assert _Transpose().forward_spans(spans, (2, 3), None, [(3, 2)]) == [None]
    assert _Transpose().inverse_spans([spans], [(3, 2)], None) is None
    assert COPY.forward_spans(spans, (2, 3), None, [(2, 3)]) == [spans]
    assert COPY.inverse_spans([spans], [(2, 3)], None) == spans
    w = torch.arange(6.0).reshape(2, 3)
    assert _bitwise(_Transpose().inverse(_Transpose().forward(w, None, [(3, 2)]), None), w)
