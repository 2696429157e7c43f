"""CRC-32 of bytes in memory: zip's checksum (zlib's polynomial), as fast as this machine computes it.

Every ``.pth``/``.bin`` record ckptkit reads is checked against the CRC-32 its zip
directory records, and every record it writes gets one, so this runs over every byte of
a Meta or torch checkpoint. zlib's ``crc32`` works a byte table at a time; zlib-ng's (the
``zlib-ng`` package, a dependency) folds with the processor's carry-less multiply
(PCLMULQDQ, VPCLMULQDQ, ARMv8 CRC) and returns the same values. Both let go of the GIL.
``bench/gguf.py`` prints the speed of each on the machine it runs on.

Where the package is missing (ckptkit installed without its dependencies) zlib's is used:
the same values, slower. :data:`IMPLEMENTATION` says which one this process uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same signature as zlib's
    from zlib import crc32
else:
    try:
        from zlib_ng.zlib_ng import crc32
    except ImportError:  # pragma: no cover - zlib-ng is a dependency; this is the safety net
        from zlib import crc32

IMPLEMENTATION = "zlib-ng" if crc32.__module__.startswith("zlib_ng") else "zlib"

__all__ = ["IMPLEMENTATION", "crc32"]
