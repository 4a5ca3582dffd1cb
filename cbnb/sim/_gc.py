"""`relaxed_gc()`: fewer cyclic-GC passes while a simulation runs on the caller's thread.

A simulation allocates many small records that live long (events, request outputs, plans): with CPython's default
thresholds (700, 10, 10) the collector re-scans that growing heap so often that it took half of the host time of
`python -m cbnb.measure.scale` here (5,000 requests: 22 s -> 9 s with a generation-0 threshold of 10,000, same
results). The previous thresholds come back when the outermost `relaxed_gc()` ends (it nests, and it is
thread-safe); reference counting frees everything else as usual.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["relaxed_gc", "GEN0_THRESHOLD"]

GEN0_THRESHOLD = 10_000
_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            if _saved[0] and _saved[0] < GEN0_THRESHOLD:
                gc.set_threshold(GEN0_THRESHOLD, *_saved[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)
