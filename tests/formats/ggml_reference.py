"""llama.cpp's own quantizers as the reference for ckptkit's encoders: ``ggml-quants.c`` from
the llama-cpp-python sdist (the llama.cpp that ``tokenizer_helpers.LLAMA_CPP_PYTHON`` pins),
compiled once into a shared library in the test cache and called with ctypes.

The build: ``cc -O2 -DNDEBUG -fPIC -ffp-contract=off`` (no ``-march``: baseline x86-64, so no FMA
either way), as the ``llama-quantize`` that ckptkit equals is built (docs/formats.md). The
library has the ``quantize_row_*_ref`` functions that ``llama-quantize`` calls when it is
given no imatrix; the few ggml functions they name but never reach abort.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from tokenizer_helpers import LLAMA_CPP_PYTHON, _cache_lock, _pip_download, cache_dir

CFLAGS = ("-O2", "-DNDEBUG", "-fPIC", "-ffp-contract=off", "-std=gnu11")
SOURCES = (
    "ggml/include/",
    "ggml/src/ggml-quants.",
    "ggml/src/ggml-impl.h",
    "ggml/src/ggml-common.h",
    "ggml/src/ggml-cpu/",
)
STUBS = """
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) { abort(); }
size_t ggml_row_size(int type, int64_t ne) {  /* the types whose quantize_<type> is called */
    switch (type) {
        case 2: return ne / 32 * 18; case 3: return ne / 32 * 20; case 6: return ne / 32 * 22;
        case 7: return ne / 32 * 24; case 10: return ne / 256 * 84; case 11: return ne / 256 * 110;
        case 12: return ne / 256 * 144; case 13: return ne / 256 * 176;
        case 14: return ne / 256 * 210; default: abort();
    }
}
const char * ggml_type_name(int type) { abort(); }
size_t ggml_type_size(int type) { abort(); }
"""
# GGML type -> (values per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
}  # fmt: skip
# types whose llama-quantize path is ``quantize_<type>(src, dst, rows, n_per_row, NULL)`` and not the
# ``_ref`` function (IQ4_NL's searches 7 trial scales each way, its ``_ref`` none)
ENTRY_POINT = ("IQ4_NL",)


def ggml_quants_lib() -> ctypes.CDLL:
    """The compiled reference (built once into the cache)."""
    root = cache_dir() / f"llama-cpp-{LLAMA_CPP_PYTHON}" / "ggml-quants"
    lib = root / "libggml-quants-ref-3.so"  # -3: ggml_row_size for every weighted quantize_<type>
    with _cache_lock():
        if not lib.is_file():
            _build(root, lib)
    return ctypes.CDLL(str(lib))


def _build(root: Path, lib: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root))
    sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", staging, sdist=True)
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if m.name.removeprefix(prefix).startswith(SOURCES)]
        for m in wanted:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(staging, members=wanted, filter="data")
    sdist.unlink()
    (staging / "stubs.c").write_text(STUBS)
    src = staging / "ggml" / "src"
    cc = os.environ.get("CC", "cc")
    out = staging / lib.name
    cmd = [cc, *CFLAGS, "-shared", f"-I{staging / 'ggml' / 'include'}", f"-I{src}", "-o", str(out)]
    subprocess.run([*cmd, str(src / "ggml-quants.c"), str(staging / "stubs.c"), "-lm"], check=True, timeout=900)
    os.replace(out, lib)
    shutil.rmtree(staging)


def weighted_reference(kind: str, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``quantize_<kind>`` of float32 rows ``x`` (n, columns) with imatrix ``weights`` (columns,),
    as llama-quantize calls it given an imatrix: the blocks ``(n * columns / block, bytes)``."""
    per, size = BLOCKS[kind]
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(weights, np.float32)
    out = np.zeros((x.size // per, size), np.uint8)
    fn = getattr(ggml_quants_lib(), f"quantize_{kind.lower().replace('_k', '_K')}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    fn(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], w.ctypes.data)
    return out


def reference(kind: str, x: np.ndarray) -> np.ndarray:
    """What ``llama-quantize`` given no imatrix makes of float32 ``x`` (``kind``: the GGML type
    name, ``Q4_K``): ``quantize_row_<kind>_ref``, or the ``quantize_<kind>`` entry point with no
    weights for :data:`ENTRY_POINT`; the blocks ``(n, bytes)``."""
    per, size = BLOCKS[kind]
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros((x.size // per, size), np.uint8)
    name = kind.lower().replace("_k", "_K")
    if kind in ENTRY_POINT:
        entry = getattr(ggml_quants_lib(), f"quantize_{name}")
        entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        entry(x.ctypes.data, out.ctypes.data, 1, x.size, None)
        return out
    fn = getattr(ggml_quants_lib(), f"quantize_row_{name}_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out
