"""ckptkit's CRC-32 is zlib's function, computed by zlib-ng: same values on any buffer."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.io import crc32
from ckptkit.io.crc import IMPLEMENTATION


def test_the_installed_dependency_computes_it() -> None:
    """zlib-ng is a dependency: a process that silently fell back to zlib would be slow, not wrong."""
    from zlib_ng import zlib_ng

    assert IMPLEMENTATION == "zlib-ng" and crc32 is zlib_ng.crc32


@given(st.binary(max_size=5000), st.integers(0, 0xFFFFFFFF), st.integers(0, 64), st.integers(0, 64))
def test_same_value_as_zlib_from_any_start_on_any_slice(data: bytes, start: int, lo: int, cut: int) -> None:
    view = memoryview(data)[lo : max(lo, len(data) - cut)]
    assert crc32(view, start) == zlib.crc32(view, start)
    assert crc32(view) == zlib.crc32(view)


def test_continuing_in_pieces_is_the_whole_and_numpy_buffers_are_read_as_bytes() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (3 << 20) + 17, dtype=np.uint8)  # past the folding's 64-byte blocks, unaligned tail
    whole = zlib.crc32(data)
    crc = 0
    for a in range(0, len(data), 1 << 20):
        crc = crc32(data[a : a + (1 << 20)], crc)
    assert crc == whole == crc32(data)
    words = data[: 1 << 20].view(np.uint16)  # a buffer of 2-byte items: its bytes count, not its items
    assert crc32(words) == zlib.crc32(words.tobytes())
    assert crc32(b"") == 0 and crc32(b"", 1234) == 1234
