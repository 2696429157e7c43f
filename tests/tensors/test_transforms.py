"""Every transform's inverse restores its input bitwise, for random shapes and dtypes."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.io.spans import Span
from ckptkit.tensors.transforms import (
    COPY,
    FUSED,
    RANKS,
    ROPE_K,
    ROPE_Q,
    STACKED,
    STACKED_PAIRS,
    RopePermute,
    Stacked,
    Transform,
)


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

    class _ForwardOnly(Transform):  # half a kind (its inverse the identity's): still no span maps
        def forward(self, native, cfg, shapes):
            return [-native]

    assert _ForwardOnly().forward_spans(spans, (2, 3), None, [(2, 3)]) == [None]
    assert _ForwardOnly().inverse_spans([spans], [(2, 3)], None) is None


# --- the span maps: the bytes the tensor transforms move, located in files -------------------


def _scattered(folder: Path, data: bytes, cuts: list[int]) -> list[Span]:
    """``data`` cut at ``cuts`` and stored in a file piece by piece, last piece first with
    gaps between them: the spans (in ``data``'s order) of where each piece lies."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    path = folder / f"blob{len(list(folder.iterdir()))}.bin"
    blob, spans = bytearray(), {}
    for i in reversed(range(len(pieces))):
        blob += b"\x5a" * 3
        spans[i] = Span(path, len(blob), len(pieces[i]))
        blob += pieces[i]
    path.write_bytes(bytes(blob))
    return [spans[i] for i in range(len(pieces))]


def _read(spans: list[Span]) -> bytes:
    return b"".join(s.path.read_bytes()[s.offset : s.offset + s.nbytes] for s in spans)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


CUTS = st.lists(st.integers(1, 4000), max_size=6)


@settings(max_examples=40, deadline=None)
@given(kv=st.integers(1, 3), group=st.integers(1, 3), half=st.integers(1, 4), cols=st.integers(0, 5),
       dtype=DTYPES, cuts=CUTS, seed=st.integers(0, 999))  # fmt: skip
def test_rope_span_maps_locate_the_permuted_rows(
    kv: int, group: int, half: int, cols: int, dtype: torch.dtype, cuts: list[int], seed: int
) -> None:
    """q (num_heads) and k (num_kv_heads, GQA): the bytes at forward_spans / inverse_spans
    are forward's / inverse's tensors, wherever the input's bytes lie."""
    cfg = SimpleNamespace(num_heads=kv * group, num_kv_heads=kv)
    with tempfile.TemporaryDirectory() as tmp:
        for rope, heads in ((RopePermute("num_heads"), kv * group), (RopePermute("num_kv_heads"), kv)):
            assert rope.name in (ROPE_Q.name, ROPE_K.name)
            shape = (heads * half * 2, cols) if cols else (heads * half * 2,)
            w = _random(shape, dtype, seed)
            spans = _scattered(Path(tmp), _bytes(w), cuts)
            assert _read(rope.forward_spans(spans, shape, cfg, [shape])[0]) == _bytes(rope.forward(w, cfg, [shape])[0])
            assert _read(rope.inverse_spans([spans], [shape], cfg)) == _bytes(rope.inverse([w], cfg))
    assert ROPE_Q.name == "rope(num_heads)" and ROPE_K.name == "rope(num_kv_heads)"


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(0, 5), cuts=CUTS,
       data=st.data(), seed=st.integers(0, 999))  # fmt: skip
def test_rope_rows_compose_with_any_row_order_as_taking_rows_of_the_forward_spans(
    heads: int, half: int, cols: int, cuts: list[int], data: st.DataObject, seed: int
) -> None:
    """forward_rows(order) locates rows ``order`` of the forward tensor (composed, not
    taken from a span per row); the other transforms have none to compose."""
    cfg = SimpleNamespace(num_heads=2 * heads, num_kv_heads=heads)  # k: GQA, half the heads
    for rope in (ROPE_Q, ROPE_K):
        n = getattr(cfg, rope.heads)
        shape = (n * half * 2, cols) if cols else (n * half * 2,)
        w = _random(shape, torch.bfloat16, seed)
        order = data.draw(st.lists(st.integers(0, shape[0] - 1), max_size=2 * shape[0]))
        with tempfile.TemporaryDirectory() as tmp:
            spans = _scattered(Path(tmp), _bytes(w), cuts)
            expected = _bytes(rope.forward(w, cfg, [shape])[0][order]) if order else b""
            assert _read(rope.forward_rows(spans, shape, cfg, order)) == expected
            for outside in ([shape[0]], [-1], [0, -1]):
                with pytest.raises(ValueError):
                    rope.forward_rows(spans, shape, cfg, outside)
            assert rope.permutes_rows and not any(t.permutes_rows for t in (COPY, FUSED, STACKED))
            assert COPY.forward_rows(spans, shape, cfg, order) is None


def test_rope_rows_back_to_meta_order_are_the_stored_span() -> None:
    """llama.cpp's Q/K permutation (to Meta's order) of the HF view of a Meta tensor is
    the tensor as stored: one span, whatever the head count."""
    from ckptkit.formats.gguf.rows import head_order

    for heads, rows in ((1, 2), (4, 64), (32, 4096), (8, 1024)):
        stored = [Span(Path("/x.pth"), 64, rows * 16)]
        cfg = SimpleNamespace(num_heads=heads)
        assert ROPE_Q.forward_rows(stored, (rows, 8), cfg, head_order(rows, heads)) == stored


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(any), cols=st.integers(1, 5),
       dtype=DTYPES, cuts=CUTS, seed=st.integers(0, 999))  # fmt: skip
def test_fused_span_maps_locate_each_part(
    sizes: list[int], cols: int, dtype: torch.dtype, cuts: list[int], seed: int
) -> None:
    """A part the config lacks (None) is 0 rows."""
    w = _random((sum(sizes), cols), dtype, seed)
    expected = [(n, cols) if n else None for n in sizes]
    shapes = FUSED.part_shapes(tuple(w.shape), expected)
    assert shapes == [(n, cols) for n in sizes]
    parts = FUSED.forward(w, None, shapes)
    with tempfile.TemporaryDirectory() as tmp:
        spans = _scattered(Path(tmp), _bytes(w), cuts)
        located = FUSED.forward_spans(spans, tuple(w.shape), None, shapes)
        assert [_read(s) for s in located] == [_bytes(p) for p in parts]
        part_spans = [_scattered(Path(tmp), _bytes(p), cuts) for p in parts]
        assert _read(FUSED.inverse_spans(part_spans, shapes, None)) == _bytes(FUSED.inverse(parts, None)) == _bytes(w)


@settings(max_examples=40, deadline=None)
@given(k=st.sampled_from([1, 2]), experts=st.integers(1, 4), rows=st.integers(1, 4), cols=st.integers(1, 4),
       dtype=DTYPES, cuts=CUTS, seed=st.integers(0, 999))  # fmt: skip
def test_stacked_experts_split_into_their_parts_in_order(
    k: int, experts: int, rows: int, cols: int, dtype: torch.dtype, cuts: list[int], seed: int
) -> None:
    """[E, k * R, C] holds expert 0's k parts, then expert 1's...: as tensors and as spans."""
    stacked = Stacked(k)
    assert stacked.name == f"stacked({k})"
    w = _random((experts, k * rows, cols), dtype, seed)
    expected = [(rows, cols)] * (experts * k)
    shapes = stacked.part_shapes(tuple(w.shape), expected)
    parts = stacked.forward(w, None, shapes)
    reference = [w[e, j * rows : (j + 1) * rows] for e in range(experts) for j in range(k)]
    assert all(_bitwise(p, r.contiguous()) for p, r in zip(parts, reference, strict=True))
    assert _bitwise(stacked.inverse(parts, None), w) and stacked.native_shape(shapes) == tuple(w.shape)
    with tempfile.TemporaryDirectory() as tmp:
        located = stacked.forward_spans(_scattered(Path(tmp), _bytes(w), cuts), tuple(w.shape), None, shapes)
        assert [_read(s) for s in located] == [_bytes(p) for p in parts]


def test_stacked_and_fused_shape_mistakes_say_what_the_config_implies() -> None:
    with pytest.raises(ValueError, match=r"^7 rows but the config implies 3 \+ 0 \+ 2$"):
        FUSED.part_shapes((7, 4), [(3, 4), None, (2, 4)])
    with pytest.raises(ValueError, match=r"^cannot split 7 rows into \[3, 2\]$"):
        FUSED.forward(torch.zeros(7, 4), None, [(3, 4), (2, 4)])
    with pytest.raises(ValueError, match=r"^shape \[4, 6\], not the 3-D stack of 2 expert parts$"):
        STACKED.part_shapes((4, 6), [(3, 6), (3, 6)])
    with pytest.raises(ValueError, match=r"^shape \[2, 3, 6\], not the 3-D stack of 2 expert parts$"):
        STACKED.part_shapes((2, 3, 6), [(3, 6), None])
    with pytest.raises(ValueError, match=r"^shape \[2, 3, 6\] but the config implies \[2, 3, 5\]$"):
        STACKED.part_shapes((2, 3, 6), [(3, 5), (3, 5)])
    with pytest.raises(ValueError, match=r"^shape \[2, 3, 6\] but the config implies \[2, 3, 6\]$"):
        STACKED.part_shapes((2, 3, 6), [(3, 6), (3, 5)])  # the experts' parts differ
    with pytest.raises(ValueError, match=r"^shape \[2, 5, 6\] but the config implies \[2, 3, 6\]$"):
        STACKED_PAIRS.part_shapes((2, 5, 6), [(1, 6), (2, 6), (1, 6), (2, 6)])
    with pytest.raises(ValueError, match=r"^dim 1 of size 5 does not split into 2 ranks$"):
        RANKS.inverse(torch.zeros(4, 5), 2, 1)
    with pytest.raises(ValueError, match=r"^dim 0 of size 5 does not split into 2 ranks$"):
        RANKS.inverse_spans([], (5, 4), 2, 0)


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 4), rows=st.integers(1, 4), cols=st.integers(1, 4), dim=st.sampled_from([0, 1, None]),
       dtype=DTYPES, cuts=CUTS, seed=st.integers(0, 999))  # fmt: skip
def test_rank_span_maps_locate_the_merged_and_split_bytes(
    ranks: int, rows: int, cols: int, dim: int | None, dtype: torch.dtype, cuts: list[int], seed: int
) -> None:
    """Shards whose bytes lie in pieces (cut anywhere, even inside a row) merge and split as torch.cat / chunk do."""
    shape = (rows * (ranks if dim == 0 else 1), cols * (ranks if dim == 1 else 1))
    w = _random(shape, dtype, seed)
    shards = RANKS.inverse(w, ranks, dim)
    shard = RANKS.shard_shape(shape, ranks, dim)
    with tempfile.TemporaryDirectory() as tmp:
        shard_spans = [_scattered(Path(tmp), _bytes(s), cuts) for s in shards]
        assert _read(RANKS.forward_spans(shard_spans, shard, dim)) == _bytes(RANKS.forward(shards, dim)) == _bytes(w)
        located = RANKS.inverse_spans(_scattered(Path(tmp), _bytes(w), cuts), shape, ranks, dim)
        assert [_read(s) for s in located] == [_bytes(s) for s in shards]


def test_rank_merge_of_shards_that_each_lie_in_pieces() -> None:
    """Every shard cut inside a row (no shard one span per row): the merged bytes are torch.cat's."""
    w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    with tempfile.TemporaryDirectory() as tmp:
        for dim in (0, 1):
            shards = RANKS.inverse(w, 2, dim)
            pieces = [_scattered(Path(tmp), _bytes(s), [s.nbytes // 2 + 2]) for s in shards]
            merged = RANKS.forward_spans(pieces, tuple(shards[0].shape), dim)
            assert _read(merged) == _bytes(RANKS.forward(shards, dim)) == _bytes(w)
