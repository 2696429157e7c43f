"""How far a conversion raises the peak resident memory of a fresh process (run as a script:
``peak_rss.py SRC DST TO WARM WARM_DST [DTYPE]``, prints the growth in bytes), so that what earlier
tests left in a test worker's heap cannot count (tests/quant/test_streaming.py)."""

from __future__ import annotations

import sys
from pathlib import Path


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(key)


def peak_growth(run: object) -> int:
    """How far the process's resident memory rose above where it stood while ``run()`` ran.
    glibc first hands its free heap pages back (``malloc_trim``) and maps every allocation of
    64 KiB or more on its own (``M_MMAP_THRESHOLD`` fixed), so that memory freed earlier, or
    by one tensor for the next, is not resident already where the peak could not see it."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    run()  # type: ignore[operator]
    return _status("VmHWM") - before


def main(src: str, dst: str, to: str, warm: str, warm_dst: str, dtype: str = "bfloat16") -> None:
    from ckptkit.convert import ConvertOptions, convert

    opts = ConvertOptions(to, dtype=dtype, gguf_pre="llama-bpe" if to == "gguf" else None)
    convert(Path(warm), Path(warm_dst), opts)  # the same code on a tiny source: imports, pools, caches
    print(peak_growth(lambda: convert(Path(src), Path(dst), opts)))


if __name__ == "__main__":
    main(*sys.argv[1:])
