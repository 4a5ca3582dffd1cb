"""`SimClock`: the tuning lab's driver clock over a `SimEngine` (virtual time, driven from the caller's thread).

`cbnb.lab.driver.Driver` and `cbnb.lab.tuning` (run_workload, sweep, measure_capacity) take it from the engine's
``driver_clock`` (see the clock protocol in `cbnb.lab.driver`): ``sleep_until(t)`` runs the simulation to simulated
second ``t`` (every step that starts before ``t``), ``now()`` is the caller's present (``t`` then, even when the step
running at ``t`` ends later: a request submitted at that instant arrives while that step runs and waits for it, as on
the real engine), ``drain()`` runs until every submitted request has ended. Torch-free.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["SimClock"]


class SimClock:
    """The driver's virtual clock of one `SimEngine` (``threaded = False``: the caller's thread runs the engine)."""

    threaded = False

    def __init__(self, sim: Any) -> None:
        self._sim = weakref.ref(sim)  # the engine owns its clock, not the other way round

    def _engine(self) -> Any:
        sim = self._sim()
        if sim is None:
            raise RuntimeError("the SimEngine of this clock was garbage-collected")
        return sim

    def now(self) -> float:
        """The caller's present on the simulated clock (seconds)."""
        return self._engine().present

    def sleep_until(self, t: float) -> None:
        """Run the simulation until simulated second `t`; afterwards ``now() >= t``."""
        sim = self._engine()
        if t > sim.present:
            sim.run_until(t)

    def drain(self) -> None:
        """Run until every submitted request (arrivals to come included) has ended."""
        self._engine().run()
