"""O_DIRECT writes (ckptkit.io.direct): the bytes land exactly and their neighbours are
untouched, the whole pages bypass the page cache while the partial pages at the ends go
through it, a refused or short direct write is finished buffered, and a conversion large
enough to have whole pages writes them direct and still round-trips byte for byte."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.convert import COMPUTED, ConvertOptions, convert
from ckptkit.errors import CkptkitError
from ckptkit.io import direct as directio
from ckptkit.io import stream
from ckptkit.io.spans import Span
from ckptkit.io.transfer import DIRECT, STREAM, transfer
from ckptkit.verify import verify_paths

from conftest import assert_same_files, direct_supported

ALIGN = directio.ALIGN
FILL = 0xA5


@pytest.fixture(scope="module", autouse=True)
def direct_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of the tests' temporary filesystem (where every test here writes). Where
    ``open(..., O_DIRECT)`` succeeds there, every test runs and any buffered fallback of
    ckptkit's fails it; only where the filesystem refuses is the module skipped, saying why."""
    folder = tmp_path_factory.mktemp("direct")
    if not direct_supported(folder):
        reason = f"{folder}: open(O_DIRECT) is refused by this filesystem (tmpfs before Linux 6.6?)"
        if os.environ.get("CKPTKIT_REQUIRE_DIRECT"):
            pytest.fail(f"CKPTKIT_REQUIRE_DIRECT is set, but {reason}")
        pytest.skip(reason)
    return folder


@contextmanager
def _fresh(path: Path, size: int) -> Iterator[tuple[int, directio.DirectFd]]:
    """A file of ``size`` FILL bytes, on disk and out of the page cache; yields (buffered
    fd, its O_DIRECT descriptor) and closes both."""
    path.write_bytes(bytes([FILL]) * size)
    fd = os.open(path, os.O_RDWR)
    direct = directio.DirectFd(path)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert direct.get() is not None
        yield fd, direct
    finally:
        direct.close()
        os.close(fd)


def _resident(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (``mincore``), without reading them."""
    size = path.stat().st_size
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return [bool(b & 1) for b in vec]
    finally:
        del addr
        mapped.close()


def _expected(size: int, offset: int, data: bytes) -> bytes:
    out = bytearray([FILL]) * size
    out[offset : offset + len(data)] = data
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 3 * ALIGN),
    lengths=st.lists(st.integers(1, 1_500_000), min_size=1, max_size=12),  # up to a full window
    seed=st.integers(0, 2**32 - 1),
)
def test_any_range_lands_exactly_and_leaves_its_neighbours(
    direct_dir: Path, offset: int, lengths: list[int], seed: int
) -> None:
    total = min(sum(lengths), stream.BUFFER)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    data = data.numpy().tobytes()
    parts, pos = [], 0
    for n in lengths:
        if pos < total:
            parts.append(memoryview(data)[pos : pos + n])
            pos += n
    with tempfile.TemporaryDirectory(dir=direct_dir) as tmp:
        path = Path(tmp) / "out.bin"
        size = offset + total + 2 * ALIGN + 77
        with _fresh(path, size) as (fd, direct):
            wrote_direct = directio.write_parts(fd, direct, parts, offset, threading.Lock())
        assert path.read_bytes() == _expected(size, offset, data)
    pages = (offset + total) // ALIGN - -(-offset // ALIGN)  # whole pages inside the range
    assert wrote_direct == (pages * ALIGN >= directio.MIN_DIRECT)  # short runs go buffered


def test_whole_pages_bypass_the_page_cache_and_the_ends_do_not(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    size, offset, n = 3 << 20, 1000, (2 << 20) + 123
    data = os.urandom(n)
    with _fresh(path, size) as (fd, direct):
        assert not any(_resident(path))
        wrote_direct = directio.write_parts(fd, direct, [memoryview(data)], offset)
        resident = _resident(path)
    first, last = offset // ALIGN, (offset + n - 1) // ALIGN
    assert wrote_direct
    assert resident[first] and resident[last]  # partial pages: written through the page cache
    assert not any(resident[first + 1 : last])  # whole pages: straight to the file
    assert path.read_bytes() == _expected(size, offset, data)


@pytest.mark.parametrize("shift", [0, 1, -1, ALIGN])
def test_bytes_read_into_the_staging_buffer_land_whether_or_not_in_place(tmp_path: Path, shift: int) -> None:
    """A window read where :func:`directio.place` says (shift 0) is written without being
    copied; one sitting elsewhere in the same staging buffer (as if placed for another
    offset) must still be moved into place first, overlapping itself."""
    path = tmp_path / "out.bin"
    size, offset, n = 6 << 20, 5000, (3 << 20) + 77
    data = os.urandom(n)
    view = directio.place(offset + shift, n)
    view[:] = data
    with _fresh(path, size) as (fd, direct):
        assert directio.write_parts(fd, direct, [view], offset)
    assert path.read_bytes() == _expected(size, offset, data)


def test_a_short_run_is_written_buffered(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    data = os.urandom(directio.MIN_DIRECT // 2)
    with _fresh(path, 1 << 20) as (fd, direct):
        assert not directio.write_parts(fd, direct, [memoryview(data)], 0)
        assert all(_resident(path)[: len(data) // ALIGN])
    assert path.read_bytes() == _expected(1 << 20, 0, data)


def _faulty_pwrite(direct_fd: int | None, behaviour: str):
    """``os.pwrite`` whose direct writes are refused (EINVAL), or reported 100 bytes short
    of the two pages they really wrote (a stop off a page boundary)."""
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if fd != direct_fd:
            return real(fd, data, offset)
        if behaviour == "refuse":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, memoryview(data)[: 2 * ALIGN], offset) - 100

    return pwrite


@pytest.mark.parametrize("behaviour", ["refuse", "short"])
def test_a_refused_or_short_direct_write_is_finished_buffered(
    behaviour: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out.bin"
    size, offset = 2 << 20, 333
    data = os.urandom(1 << 20)
    with _fresh(path, size) as (fd, direct):
        monkeypatch.setattr(directio.os, "pwrite", _faulty_pwrite(direct.get(), behaviour))
        try:
            wrote_direct = directio.write_parts(fd, direct, [memoryview(data)], offset)
            remembered = direct.get() is None  # a refusal sends the file's later writes buffered
        finally:
            monkeypatch.undo()
    assert wrote_direct == (behaviour == "short") and remembered == (behaviour == "refuse")
    assert path.read_bytes() == _expected(size, offset, data)


def test_two_threads_writing_neighbouring_ranges_of_one_file(tmp_path: Path) -> None:
    """Ranges of odd sizes (some spanning several 4 MiB windows) copied from a source file
    into one output by two threads in interleaved order, as a conversion's workers do."""
    sizes = [9_000_001, 70_001, 5, 4_200_000, 131_071, 1, 6_000_123, 262_147, 33, 4_194_304, 77_777]
    src = tmp_path / "src.bin"
    data = os.urandom(sum(sizes))
    src.write_bytes(data)
    out = tmp_path / "out.bin"
    base = 12_345  # an odd header length before the first range
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    lock = threading.Lock()
    with _fresh(out, base + len(data) + 999) as (fd, direct):

        def copy(i: int) -> str:
            span = Span(src, starts[i], sizes[i])
            return transfer([span], fd, base + starts[i], DIRECT, lock=lock, direct=direct).method

        with ThreadPoolExecutor(2) as pool:
            used = list(pool.map(copy, range(len(sizes))))
    assert all(u == DIRECT for u, n in zip(used, sizes, strict=True) if n >= 2 * directio.MIN_DIRECT), used
    assert all(u == STREAM for u, n in zip(used, sizes, strict=True) if n < directio.MIN_DIRECT), used
    assert out.read_bytes() == _expected(base + len(data) + 999, base, data)


def test_a_failed_conversion_leaves_no_descriptor_open(
    llama_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio, "_write_direct", full)
    with pytest.raises((OSError, CkptkitError)):
        convert(llama_hf, tmp_path / "meta", ConvertOptions("meta", copy_method=DIRECT))
    held = [
        os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")
    ]
    assert not [h for h in held if h.startswith(str(tmp_path))], held
    assert not (tmp_path / "meta").exists()


def test_open_direct_is_none_where_the_filesystem_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.touch()
    real = os.open

    def refusing(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(p))
        return real(p, flags, *a)

    monkeypatch.setattr(directio.os, "open", refusing)
    assert directio.open_direct(path) is None


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory) -> Path:
    """A Llama with whole pages in every matrix, saved by transformers (odd sizes: the
    tensors start off page boundaries)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1400, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=3001, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("direct") / "hf"
    model.save_pretrained(out, max_shard_size="3MB")
    return out


@pytest.mark.parametrize("via", ["meta", "hf-bin", "internal"])
def test_a_conversion_writes_its_whole_pages_direct_and_round_trips(via: str, llama_hf: Path, tmp_path: Path) -> None:
    there = convert(llama_hf, tmp_path / via, ConvertOptions(via, copy_method=DIRECT))
    back = convert(tmp_path / via, tmp_path / "back", ConvertOptions("hf", copy_method=DIRECT))
    for result in (there, back):
        by = result.bytes_by_method
        copied = by.get(DIRECT, 0) + by.get(STREAM, 0)
        assert set(by) <= {DIRECT, STREAM, COMPUTED}
        assert by[DIRECT] > 0.95 * copied, by  # all but the small norms go direct
    assert_same_files(llama_hf, tmp_path / "back")
    assert verify_paths(llama_hf, tmp_path / "back").ok


@pytest.mark.parametrize("limit", [1 << 20, 1 << 40, None])
def test_auto_writes_direct_only_past_the_dirty_limit(
    limit: int | None, llama_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is about 10 MB: past a 1 MiB dirty limit auto goes direct, under 1 TiB
    (or where the limit is unknown) not."""
    monkeypatch.setattr(directio, "dirty_limit", lambda: limit)
    result = convert(llama_hf, tmp_path / "meta", ConvertOptions("meta"))
    assert (DIRECT in result.bytes_by_method) == (limit == 1 << 20), result.bytes_by_method
    back = convert(tmp_path / "meta", tmp_path / "back", ConvertOptions("hf"))
    assert (DIRECT in back.bytes_by_method) == (limit == 1 << 20), back.bytes_by_method
    assert_same_files(llama_hf, tmp_path / "back")


def test_the_dirty_limit_is_a_share_of_this_machine_s_memory() -> None:
    limit = directio.dirty_limit()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert limit is not None and 0 < limit <= total
