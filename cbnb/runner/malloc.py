"""glibc malloc settings that keep CPU steps from thrashing the kernel's page allocator.

A CPU forward allocates and frees many megabyte-sized activations per layer. With glibc's defaults, big blocks come
from fresh `mmap`s and are handed back on free, so every step pays page faults and zero-filling for them again; on
the 2-core machines cbnb is tested on, that alone made `cpu-32` about 40 % slower (23.2 s vs 16.4 s, measured with
`python -m cbnb.bench`). Raising the mmap threshold to 32 MiB (glibc's ceiling for it) and the trim threshold to
1 GiB keeps freed memory in the heap for the next step. The cost: the process keeps up to that much freed memory.

It is process-wide, applied once when a CPU engine is built, Linux/glibc only; set ``CBNB_MALLOPT=0`` to opt out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings once. Returns True when they are in force (False off glibc or when opted out)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("CBNB_MALLOPT", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    _done = ok
    return ok
