"""The table gather and the in-place block arithmetic give the reference recipe's bytes:
float32 element x the block's float32 scale, one round-to-nearest-even cast, blocks cropped
at the edges, across chunk boundaries (small chunks), for every byte code (NaN included)."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.io import Span
from ckptkit.quant import scaled
from ckptkit.tensors.lazy import Lazy

CASES = [
    (300, 520, (128, 128)),  # cropped blocks both ways: the table gather
    (200, 40, (32, 40)),  # chunks of several block rows: the table gather
    (9, 2050, (1, 2048)),  # per channel (cropped), chunks of two rows: the table gather
    (130, 260, (1, 128)),  # small blocks: widened, multiplied in place
    (77, 300, (1, 32)),
    (700, 90, (700, 90)),  # one scale for the whole matrix, chunks inside its block row
    (3, 2, (128, 128)),  # a matrix smaller than one block
]


def _expanded(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    return s.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize(("rows", "cols", "block"), CASES)
def test_reference_bytes(
    monkeypatch: pytest.MonkeyPatch, stored: torch.dtype, rows: int, cols: int, block: tuple[int, int]
) -> None:
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(rows * cols)
    w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).view(stored)
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    s = torch.rand(grid, generator=g) * 2.0 ** torch.randint(-20, 6, grid, generator=g)
    s_full = _expanded(s, (rows, cols), block)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = (w.float() * s_full).to(dtype)
        got = scaled.dequantize(w, s, block, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
        q = want.float() / s_full
        back = q.round().clamp(-128, 127).to(stored) if stored == torch.int8 else q.to(stored)
        assert torch.equal(scaled.requantize(want, s, block, stored).view(torch.uint8), back.view(torch.uint8))


SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0e38, 1.0e-45, 2.0**-133, 1.0, 0.1]


@pytest.mark.parametrize("block", [(2, 512), (1, 32)])  # the table gather; widened and multiplied
@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.int8])
def test_every_code_times_special_scales(block: tuple[int, int], stored: torch.dtype) -> None:
    """Every byte code (e4m3's NaN codes included) in each block of scales that are NaN,
    infinite, zero, huge (products overflow), subnormal: torch's own multiply and cast
    (NaN's bits as torch's cast gives them on this machine)."""
    rows = 2 * len(SPECIAL)
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, 2)  # [rows, 512]: each row every code twice
    w = codes.view(stored)
    grid = torch.arange(rows // block[0])[:, None] + torch.arange(512 // block[1])
    s = torch.tensor(SPECIAL)[grid % len(SPECIAL)]  # each code in a block of each scale
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = (w.float() * _expanded(s, (rows, 512), block)).to(dtype)
        got = scaled.dequantize(w, s, block, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype


@pytest.mark.parametrize("block", [(128, 128), (1, 32)])
def test_pieces_are_the_result_in_order(monkeypatch: pytest.MonkeyPatch, block: tuple[int, int]) -> None:
    """Pieces of a few chunks each, over matrices of a stack, in two buffers used in turn:
    each piece, copied before the one after the next is made, is the result's next run."""
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 3 * 4096)
    w = torch.randint(0, 256, (2, 300, 260), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(2, math.ceil(300 / block[0]), math.ceil(260 / block[1]))
    pieces = scaled.dequantized_pieces(w, s, block, torch.bfloat16)
    got = [bytes(next(pieces))]
    for piece in pieces:
        got.append(bytes(piece))
    assert len(got) > 4
    want = scaled.dequantize(w, s, block, torch.bfloat16).view(-1)
    assert b"".join(got) == want.view(torch.uint8).numpy().tobytes()
    assert list(scaled.dequantized_pieces(w[:, :0], s, block, torch.bfloat16)) == []


def test_pieces_of_a_weight_on_disk_read_a_piece_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A lazy weight whose bytes lie in files (two spans, split inside a row) is read a
    piece's rows at a time, never whole, and gives the in-memory weight's pieces."""
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 3 * 4096)
    w = torch.randint(0, 256, (2, 300, 260), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(2, 3, 3)
    data = w.view(torch.uint8).numpy().tobytes()
    (tmp_path / "a").write_bytes(b"x" * 7 + data[:1001])
    (tmp_path / "b").write_bytes(data[1001:])
    spans = [Span(tmp_path / "a", 7, 1001), Span(tmp_path / "b", 0, len(data) - 1001)]

    def whole() -> torch.Tensor:
        raise AssertionError("the weight was read whole")

    lazy = Lazy((2, 300, 260), "float8_e4m3fn", whole, spans=lambda: spans)
    for dtype in (torch.bfloat16, torch.float32):  # four codes a read, and one
        got = [bytes(p) for p in scaled.dequantized_pieces(lazy, s, (128, 128), dtype)]
        assert len(got) > 4
        want = scaled.dequantize(w, s, (128, 128), dtype).view(-1)
        assert b"".join(got) == want.view(torch.uint8).numpy().tobytes()


def test_a_source_shortened_while_read_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A source file cut short between opening and the read of a piece: the one-line error
    naming the file, not an EOFError's traceback."""
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(scaled, "PIECE_ELEMENTS", 4096)
    w = torch.randint(0, 256, (300, 260), dtype=torch.uint8).view(torch.float8_e4m3fn)
    data = w.view(torch.uint8).numpy().tobytes()
    (tmp_path / "a").write_bytes(data)
    lazy = Lazy((300, 260), "float8_e4m3fn", lambda: w, spans=lambda: [Span(tmp_path / "a", 0, len(data))])
    pieces = scaled.dequantized_pieces(lazy, torch.rand(3, 3), (128, 128), torch.bfloat16)
    next(pieces)
    (tmp_path / "a").write_bytes(data[:5000])
    with pytest.raises(CkptkitError, match=r"a: changed while it was read \(shorter than its size\)"):
        list(pieces)


def test_a_forked_child_dequantizes_with_its_own_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept thread pool does not survive a fork (its threads stay in the parent): a child
    process dequantizing after its parent did gets a pool of its own, not a hang."""
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    w = torch.randint(0, 256, (512, 512), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(4, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = scaled.dequantize(w, s, (128, 128), torch.bfloat16)  # the parent's pool made and used
        pid = os.fork()
        if pid == 0:  # the child: exit 0 when equal; a hang is ended by the parent's kill below
            got = scaled.dequantize(w, s, (128, 128), torch.bfloat16)
            os._exit(0 if torch.equal(got.view(torch.int16), want.view(torch.int16)) else 1)
        for _ in range(200):  # 20 s at most
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung on the parent's thread pool")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


def test_a_strided_weight_gives_the_contiguous_ones_bytes() -> None:
    """Codes whose rows are not contiguous (a transposed view) go through the one-code gather."""
    w = torch.randint(0, 256, (512, 384), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(3, 4)
    got = scaled.dequantize(w.t(), s, (128, 128), torch.bfloat16)
    want = scaled.dequantize(w.t().contiguous(), s, (128, 128), torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_stacked_matrices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaled, "CHUNK_ELEMENTS", 4096)
    w = torch.randint(0, 256, (3, 300, 260), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(3, 3, 3)
    got = scaled.dequantize(w, s, (128, 128), torch.bfloat16)
    for e in range(3):
        want = (w[e].float() * _expanded(s[e], (300, 260), (128, 128))).to(torch.bfloat16)
        assert torch.equal(got[e].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3)])
def test_empty_matrices(shape: tuple[int, ...]) -> None:
    s = torch.ones(*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    w = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    assert scaled.dequantize(w, s, (128, 128), torch.bfloat16).shape == shape
    assert scaled.requantize(w.float(), s, (128, 128), torch.float8_e4m3fn).shape == shape


def test_verify_max_difference_by_chunks() -> None:
    from ckptkit.verify import _max_difference

    a = torch.zeros(3, 5)
    b = torch.zeros(3, 5, dtype=torch.bfloat16)
    a[2, 4] = 0.75  # the last chunk of four elements
    b[1, 0] = -0.5
    assert _max_difference(a, b, chunk=4) == 0.75
    a[0, 1] = float("nan")
    assert _max_difference(a, b, chunk=4) == float("inf")
    assert _max_difference(torch.zeros(0), torch.zeros(0)) == 0.0
