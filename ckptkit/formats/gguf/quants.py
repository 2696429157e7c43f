"""GGML block quantization: Q8_0 and the llama-quantize types (:mod:`.encoders`) written as
llama.cpp writes them, and Q8_0 / Q4_K / Q5_K / Q6_K read back (dequantized to float32), a
block of rows at a time.

Q8_0 is :func:`quantize_q8_0`: the ``gguf`` package's float32 operations, bit for bit,
reordered to run in cache (the block maximum as a tree of ``maximum`` over halves, not a
reduction along a 32-wide axis) and with its round-half-away-from-zero as one add before
the truncating cast (``trunc(y + copysign(0.5 - 2**-25, y))`` is ``np_roundf(y)`` for
every finite float32, checked exhaustively); blocks whose scale or inverse scale is not
finite are left to the package's own code.

Dequantization follows ggml's ``dequantize_row_*`` (the same float32 operations in the same
order, so the values are those of the ``gguf`` package's reference, bit for bit), written
with torch over whole rows of blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ckptkit.formats.gguf import nvfp4
from ckptkit.tensors.casting import checked_cast

if TYPE_CHECKING:
    import numpy as np
    import torch

T = TypeVar("T")

CHUNK_BYTES = 16 << 20  # float32 bytes quantized, or stored bytes dequantized, at a time
QK_K = 256
Q8_BLOCKS = 4096  # Q8_0 blocks quantized per pass: 512 KiB of float32, in cache


def quantized_chunks(
    t: torch.Tensor, qtype: Any, checked_as: str | None = None, weights: np.ndarray | None = None
) -> Iterator[bytes]:
    """The GGML bytes of ``t`` as llama.cpp makes them (anything but float16/float32 cast to
    float32, then the ``gguf`` package's quantization), a block of whole rows at a time: row
    blocks quantize independently and the cast is per element, so the bytes are those of
    quantizing it whole. A bfloat16 tensor written as BF16 is its own bytes, NaNs quieted
    as the package's rounding quiets them (no float32 copy, no rounding to do). With
    ``checked_as`` (the tensor's name), a cast to F16 / BF16 that overflows a value is a
    one-line error naming it, and its underflows are counted for the conversion's note
    (:func:`~ckptkit.tensors.casting.checked_cast`). ``weights`` (imatrix, ``(experts, columns)``):
    a type of :data:`~ckptkit.formats.gguf.weighted.WEIGHTED` quantized row by row with them.
    A uint8 ``t`` is its type's GGML bytes already (MXFP4 kept as stored): written as it is."""
    import gguf
    import numpy as np
    import torch

    if t.dim() == 0:
        t = t.reshape(1)
    rows = t.reshape(-1, t.shape[-1])
    narrow = {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16}
    step = max(1, CHUNK_BYTES // max(1, t.shape[-1] * 4))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].contiguous()
        if chunk.dtype == torch.uint8:  # already the type's GGML bytes (MXFP4 kept as stored)
            yield chunk.numpy().tobytes()
            continue
        if chunk.dtype == torch.bfloat16 and qtype == gguf.GGMLQuantizationType.BF16:
            yield bf16_bytes(chunk)
            continue
        target = narrow.get(qtype)
        if checked_as is not None and target is not None and chunk.dtype != target:
            checked_cast(chunk, target, checked_as, "", allow_lossy=False)
        if chunk.dtype not in (torch.float16, torch.float32):
            chunk = chunk.to(torch.float32)
        if weights is not None and (weighted := _weighted(qtype)) is not None:
            per = rows.shape[0] // weights.shape[0]
            row_weights = weights[np.arange(start, start + len(chunk)) // per]
            yield encode_weighted(weighted, chunk.numpy().astype(np.float32), row_weights).tobytes()
        elif qtype == gguf.GGMLQuantizationType.Q8_0:
            yield quantize_q8_0(chunk.numpy().reshape(-1, 32)).tobytes()
        elif _encoder_of(qtype):
            yield encode_blocks(gguf.GGMLQuantizationType(qtype).name, chunk.numpy()).tobytes()
        else:
            yield gguf.quants.quantize(chunk.numpy(), qtype).tobytes()


FLOATS = ("F32", "F16", "BF16")  # GGML types with no block encoder (what imports numba is not needed)


def _weighted(qtype: Any) -> Any:
    """The imatrix-weighted quantizer of ``qtype`` (None: none), imported only when asked."""
    import gguf

    from ckptkit.formats.gguf.weighted import WEIGHTED

    return WEIGHTED.get(gguf.GGMLQuantizationType(qtype).name)


def _encoder_of(qtype: Any) -> bool:
    """Whether ``qtype`` has one of ckptkit's block encoders; a float type never imports them."""
    import gguf

    name = gguf.GGMLQuantizationType(qtype).name
    if name in FLOATS:
        return False
    from ckptkit.formats.gguf.encoders import ENCODERS

    return name in ENCODERS


class _Workers:
    """Threads beside the caller's for quantization (Q8_0, the encoders, imatrix-weighted): one
    fewer than the CPUs this process may run on (at most 7), started on first use."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._count = min(cpus, 8) - 1

    def __len__(self) -> int:
        return self._count

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._count, thread_name_prefix="ckptkit-q8")
        return self._pool


_WORKERS = _Workers()


def quantize_q8_0(blocks: np.ndarray, bf16: bool = False) -> np.ndarray:
    """The Q8_0 bytes, (n, 34) uint8, of ``blocks``: (n, 32) float32 or float16, or with
    ``bf16`` the bfloat16 bits as uint16, widened to float32 first as llama.cpp does. The
    same bytes as ``gguf.quants.quantize(blocks.astype(float32), Q8_0)``.

    Every step runs over a flat run of :data:`Q8_BLOCKS` blocks (long inner loops): the
    block maximum is five ``maximum`` passes of the run against itself shifted by 16, 8, 4,
    2 and 1 (the first element of each block ends up holding its block's maximum), and the
    rounding is one add of ``0.5 - 2**-25`` carrying the value's sign before the cast."""
    import numpy as np

    n = blocks.shape[0]
    out = np.empty((n, 34), np.uint8)
    parts = min(len(_WORKERS) + 1, n // Q8_BLOCKS)
    if parts < 2:
        return _quantize_q8_0_into(blocks, bf16, out)
    # the blocks split over this process's CPUs: numpy lets go of the GIL in its loops, and
    # every block is quantized on its own, so the bytes are those of one pass
    cut = [n * i // parts for i in range(parts + 1)]
    pool, spans = _WORKERS.pool(), zip(cut[1:-1], cut[2:], strict=True)
    pending = [pool.submit(_quantize_q8_0_into, blocks[a:b], bf16, out[a:b]) for a, b in spans]
    try:
        _quantize_q8_0_into(blocks[: cut[1]], bf16, out[: cut[1]])
    finally:
        for done in pending:
            done.result()
    return out


ENCODE_BLOCKS = 1 << 18  # values per encoder call (1 MiB of float32: per-call overheads small)


def encode_blocks(kind: str, x: np.ndarray) -> np.ndarray:
    """The ``kind`` blocks (:data:`~ckptkit.formats.gguf.encoders.ENCODERS`) of float32 or
    float16 ``x``, (n, block bytes) uint8: parts of :data:`ENCODE_BLOCKS` values encoded on
    this process's CPUs (numpy lets go of the GIL; every block is encoded on its own)."""
    import numpy as np

    from ckptkit.formats.gguf.encoders import ENCODERS

    enc = ENCODERS[kind]
    flat = x.reshape(-1)
    out = np.empty((flat.size // enc.BLOCK, enc.SIZE), np.uint8)
    step = ENCODE_BLOCKS // enc.BLOCK * enc.BLOCK

    def part(first: int) -> None:
        piece = flat[first : first + step].astype(np.float32)
        with np.errstate(all="ignore"):
            out[first // enc.BLOCK : (first + piece.size) // enc.BLOCK] = enc.encode(piece)

    _spread(part, range(0, flat.size, step))
    return out


def encode_weighted(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """``fn`` (of :data:`~ckptkit.formats.gguf.weighted.WEIGHTED`) of float32 rows ``x`` and
    their imatrix weights ``qw`` (as ``x``): parts of whole rows, about :data:`ENCODE_BLOCKS`
    values each, quantized on this process's CPUs (every row is quantized on its own)."""
    import numpy as np

    step = max(1, ENCODE_BLOCKS // max(1, x.shape[1]))
    parts = _spread(lambda first: fn(x[first : first + step], qw[first : first + step]), range(0, x.shape[0], step))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _spread(part: Callable[[int], T], starts: range) -> list[T]:
    """``part`` of each of ``starts``, in order, on the worker threads when there are two or more."""
    if len(starts) < 2 or not len(_WORKERS):
        return [part(first) for first in starts]
    return [done.result() for done in [_WORKERS.pool().submit(part, first) for first in starts]]


def _quantize_q8_0_into(blocks: np.ndarray, bf16: bool, out: np.ndarray) -> np.ndarray:
    """:func:`quantize_q8_0` of ``blocks`` into ``out`` ((n, 34) uint8), in this thread."""
    import numpy as np
    from gguf.quants import Q8_0

    n = blocks.shape[0]
    fields = out.view(np.dtype([("d", "<f2"), ("qs", "V32")])).reshape(n)
    step = max(1, min(n, Q8_BLOCKS))
    x, a, b = (np.empty(step * 32, np.float32) for _ in range(3))
    q = np.empty(step * 32, np.int8)
    half_down = np.nextafter(np.float32(0.5), np.float32(0)).view(np.uint32)  # 0.5 - 2**-25
    sign = np.uint32(0x80000000)
    for first in range(0, n, step):
        c = min(step, n - first)
        size = c * 32
        xc, ac, bc = x[:size], a[:size], b[:size]
        src = blocks[first : first + c].reshape(-1)
        if bf16:
            bits = xc.view(np.uint32)
            bits[...] = src
            bits <<= 16
        else:
            xc[...] = src
        m, other = np.abs(xc, out=ac), bc
        for w in (16, 8, 4, 2, 1):  # m[32 i] becomes max |x| over block i
            np.maximum(m[:-w], m[w:], out=other[:-w])
            m, other = other, m
        d = m[::32] / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.float32(1) / d
        inv[d == 0] = 0
        if not (np.isfinite(d).all() and np.isfinite(inv).all()):
            with np.errstate(all="ignore"):  # NaN, inf or a subnormal scale: the package's own code
                out[first : first + c] = Q8_0.quantize_blocks(xc.reshape(c, 32))
            continue
        y = np.multiply(xc, np.repeat(inv, 32), out=xc)
        rounding = np.bitwise_and(y.view(np.uint32), sign, out=ac.view(np.uint32))
        np.bitwise_or(rounding, half_down, out=rounding)
        np.add(y, ac, out=y)  # y + copysign(0.5 - 2**-25, y), truncated by the cast below
        np.copyto(q[:size], y, casting="unsafe")
        fields["qs"][first : first + c] = q[:size].view("V32")
        fields["d"][first : first + c] = d.astype(np.float16)
    return out


def bf16_bytes(t: torch.Tensor) -> bytes:
    """A bfloat16 tensor's bytes as float32 -> BF16 rounding gives them: unchanged, except that
    a NaN gets its quiet bit (0x0040) set."""
    import numpy as np
    import torch

    bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    nan = (bits & 0x7FFF) > 0x7F80
    if nan.any():
        bits = np.where(nan, bits | np.uint16(0x0040), bits)
    return bytes(bits.tobytes())


# --- dequantization ------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from (n, 2) bytes, as float32."""
    import torch

    return b.contiguous().view(torch.float16).to(torch.float32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    import torch

    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in 12 bytes."""
    import torch

    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Low then high nibbles of each ``group`` bytes: (n, k * group) -> (n, 2k, group)."""
    import torch

    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(n, -1, group)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:144], 32).float()
    return ((d * sc).reshape(n, 8, 1) * q - (dmin * mn).reshape(n, 8, 1)).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    import torch

    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)
    high = torch.cat([(qh >> i) & 1 for i in range(8)], dim=1)
    q = (_nibbles(b[:, 48:176], 32) | (high << 4)).float()
    return ((d * sc).reshape(n, 8, 1) * q - (dmin * mn).reshape(n, 8, 1)).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    import torch

    n = b.shape[0]
    low = _nibbles(b[:, 0:128], 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, QK_K)


# GGML type name -> (elements per block, bytes per block, dequantize (n, bytes) -> (n, elements))
DEQUANTIZE: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
    "NVFP4": (nvfp4.SUPER, 36, nvfp4.ggml_values),  # the package's values, the sign of -0 kept
}


def dequantizer(kind: str) -> tuple[int, int, Callable[[torch.Tensor], torch.Tensor]] | None:
    """(elements per block, bytes per block, dequantize) of GGML type ``kind``: ckptkit's own
    for the types above, else the ``gguf`` package's reference for every type it implements
    (Q4_0..Q5_1, Q2_K, Q3_K, the IQ and TQ types, MXFP4, NVFP4); None when neither does."""
    if kind in DEQUANTIZE:
        return DEQUANTIZE[kind]
    import gguf
    import gguf.quants

    qtype = getattr(gguf.GGMLQuantizationType, kind, None)
    if qtype is None or qtype not in gguf.quants._type_traits or kind in ("F32", "F16", "BF16"):
        return None
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]

    def fn(b: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.from_numpy(gguf.quants.dequantize(b.numpy(), qtype).astype("float32"))

    return per_block, block_bytes, fn


def dequantize_into(
    out: torch.Tensor,
    kind: str,
    read: Callable[[int, int], bytes | bytearray | memoryview],
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Fill float32 ``out`` from the ``kind`` blocks that ``read(offset, n)`` returns, a chunk
    of whole blocks at a time (the stored bytes are never all in memory), decoded by
    ``decode`` (uint8 (n, block bytes) -> (n, block values)) where given."""
    import torch

    found = dequantizer(kind)
    if found is None:  # pragma: no cover - the reader refuses these first
        raise ValueError(f"no dequantizer for {kind}")
    per_block, block_bytes, fn = found
    fn = decode or fn
    flat = out.reshape(-1)
    blocks = flat.numel() // per_block
    step = max(1, CHUNK_BYTES // block_bytes)
    for first in range(0, blocks, step):
        n = min(step, blocks - first)
        data = read(first * block_bytes, n * block_bytes)
        b = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(n, block_bytes)
        flat[first * per_block : (first + n) * per_block] = fn(b).reshape(-1)
    return out
