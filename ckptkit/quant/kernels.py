"""The compiled loops of :mod:`ckptkit.quant.scaled`: one pass over a chunk of rows of a
matrix of one-byte codes scaled on a grid of blocks (imported when a matrix is dequantized,
so that numba loads with the first quantized tensor, not with the command line).

Each loop reads a code once and writes its element once; the chunk's rows may start inside
a block row (``r0``: the chunk's first row in the matrix). Codes are bytes, so a lookup in a
256-entry table never leaves it."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ckptkit.tensors.compiled import kernel

LITTLE_ENDIAN = sys.byteorder == "little"  # what gather4 reads four codes as


@kernel
def gather(codes: Any, tables: Any, br: int, bc: int, r0: int, into: Any) -> None:
    """``into[i, j] = tables[block of (r0 + i, j), codes[i, j]]``: ``tables`` [blocks of the
    matrix (row-major), 256] holds each block's 256 results (any item type: they are copied)."""
    rows, cols = codes.shape
    sc = (cols + bc - 1) // bc
    for i in range(rows):
        first = (r0 + i) // br * sc
        for b in range(sc):
            table = tables[first + b]
            for j in range(b * bc, min(cols, (b + 1) * bc)):
                into[i, j] = table[codes[i, j]]


@kernel
def widen_scale(codes: Any, wide: Any, scales: Any, br: int, bc: int, r0: int, into: Any) -> None:
    """``into[i, j] = wide[codes[i, j]] * scales[block of (r0 + i, j)]`` in float32 (one
    rounding): ``wide`` [256] float32, ``scales`` [block rows, block columns] float32."""
    rows, cols = codes.shape
    sc = scales.shape[1]
    for i in range(rows):
        row = scales[(r0 + i) // br]
        for b in range(sc):
            s = row[b]
            for j in range(b * bc, min(cols, (b + 1) * bc)):
                into[i, j] = wide[codes[i, j]] * s


@kernel
def gather4(codes: Any, tables: Any, br: int, bc: int, r0: int, into: Any) -> None:
    """:func:`gather` of two-byte results (``tables`` uint16, ``into`` uint16) four codes at a
    time: one four-byte read of codes and one eight-byte write of results (the columns and
    ``bc`` multiples of 4; rows contiguous)."""
    rows, cols = codes.shape
    sc = (cols + bc - 1) // bc
    words = codes.view(np.uint32)  # little-endian: the first code in the low byte
    out = into.view(np.uint64)
    for i in range(rows):
        first = (r0 + i) // br * sc
        for b in range(sc):
            t = tables[first + b]
            for j in range(b * bc // 4, min(cols, (b + 1) * bc) // 4):
                w = words[i, j]
                out[i, j] = (
                    np.uint64(t[w & 0xFF])
                    | (np.uint64(t[(w >> 8) & 0xFF]) << 16)
                    | (np.uint64(t[(w >> 16) & 0xFF]) << 32)
                    | (np.uint64(t[w >> 24]) << 48)
                )
