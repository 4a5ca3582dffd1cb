"""`submitted_together(engine)`: every submission made inside the block reaches a `cbnb.Engine`'s core in one loop
turn, before any step, as a workload "all submitted before start()" (for `validate` and `calibrate`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

__all__ = ["submitted_together"]


@contextlib.contextmanager
def submitted_together(engine: Any, timeout: float = 600.0) -> Iterator[None]:
    """Hold the engine's loop before its next inbox drain while the block runs (the engine is started if needed).

    At most `cbnb.engine.inbox.MAX_SUBMISSIONS_PER_TURN` submissions are taken in that turn, as always.
    """
    gate = threading.Event()
    held = threading.Event()
    loop = engine._loop
    orig = loop.drain

    def gated_drain():
        held.set()
        gate.wait(timeout)
        return orig()

    loop.drain = gated_drain  # type: ignore[method-assign]
    engine.start()  # after patching, so that a fresh loop's very first drain is held too
    # A running loop may be inside an unpatched drain right now (it looked the method up just before the patch; on a
    # loaded machine that moment can last long enough to take the block's first submission alone): wake it and wait
    # until it holds at the gate, so that everything submitted in the block is drained in one turn.
    loop.inbox.wakeup.set()
    held.wait(timeout)
    try:
        yield
    finally:
        loop.drain = orig  # type: ignore[method-assign]
        gate.set()
