"""What `cbnb.measure.calibrate` and its two back-ends (`_calibrate_torch`, `_calibrate_numpy`) share: the row counts
measured and the timing helpers. Its own module so that the back-ends never import `calibrate` (which imports them).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

__all__ = ["_ROWS", "_ATT_ROWS", "_median_time", "_positive"]

_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_ATT_ROWS = (16, 64, 256, 512)


def _median_time(fn: Callable[[], Any], reps: int, min_s: float = 0.0) -> float:
    """The median wall seconds of `fn()` over at least `reps` calls and `min_s` seconds (after one warm-up)."""
    fn()  # warm-up
    ts = []
    while len(ts) < reps or sum(ts) < min_s:
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        if len(ts) >= 50 * reps:
            break
    return statistics.median(ts)


def _positive(x: float, floor: float) -> float:
    return x if math.isfinite(x) and x > floor else floor
