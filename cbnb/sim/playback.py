"""`Playback`: a `SimEngine` on its own thread, as fast as possible or paced at ``speed`` x simulated time (torch-free).

The thread runs the engine loop's own turns (`cbnb.engine.loop.turn`) under the engine's lock, one turn at a time, so
API calls from other threads (submit, cancel, reconfigure, the dashboard's reads) land between turns, as they land
between the real engine's loop turns. It is the turns' driver (`cbnb.sim.arrivals`): idle time passes as

- ``speed=None``: no waiting; when nothing can run before the next arrival, the clock jumps to it;
- ``speed=x``: after each turn that ran a step the thread sleeps until the wall clock has caught up with ``x``
  simulated seconds per wall second, and an idle gap before an arrival takes its wall time at x, so a dashboard's
  panels animate; when the simulation cannot keep up (a turn costs more host time than its simulated span / x), it
  runs flat out and the pace restarts from where it is (no burst to catch up).

With no request left and none to come, the thread waits for a submission; the virtual clock does not advance while
it waits. The step mode is the loop's (`cbnb.engine.step_mode`): while paused the loop holds in its turn (the step in
flight applied, arrivals that are due admitted, the clock standing), and runs one step per `step()`; with a step
rate it waits between steps (slow motion). Neither held nor slow-motion wall time counts as simulated time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..engine.loop import turn
from ..engine.phases import IDLE, STOPPED

__all__ = ["Playback", "check_speed"]

IDLE_WAIT_S = 0.5  # a wait for submissions re-checks the stop flag this often
MAX_LAG_S = 0.25  # wall seconds behind the pace before the pace restarts


def check_speed(speed: Any) -> float | None:
    """`speed` as a float > 0, or None (as fast as possible).

    Raises:
        ValueError: naming `speed`, for anything else.
    """
    if speed is None:
        return None
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0 or speed == float("inf"):
        raise ValueError(f"speed must be a number > 0 (x simulated time) or None (as fast as possible); got {speed!r}")
    return float(speed)


class Playback:
    """The thread of one `SimEngine` (see the module docstring), and the driver of its turns.

    Args:
        sim: the engine (its `_loop`, `_arrivals`, `_clock`, `_die`).
        speed: simulated seconds per wall second, or None.
    """

    def __init__(self, sim: Any, speed: float | None) -> None:
        self.sim = sim
        self.speed = speed
        self.clock = sim._clock
        self.stop_flag = threading.Event()
        self.idle = threading.Event()  # set while nothing is left to do
        self.waiting_for: float | None = None  # the arrival (simulated s) an idle wait is pacing towards
        self._anchor = (time.monotonic(), 0.0)
        self.thread = threading.Thread(target=self._run, name="cbnb-sim", daemon=True)

    def start(self) -> None:
        self._anchor = (time.monotonic(), self.clock.now)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.stop_flag.set()
        self.sim._arrivals.wake()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def set_speed(self, speed: float | None) -> None:
        self.speed = speed
        self._anchor = (time.monotonic(), self.clock.now)
        self.sim._arrivals.wake()

    def paced_now(self) -> float:
        """The simulated time now: the loop's clock, or during an idle wait for an arrival, where the pace is."""
        now, target = self.clock.now, self.waiting_for
        if target is None or self.speed is None:
            return now
        wall0, sim0 = self._anchor
        return max(now, min(target, sim0 + (time.monotonic() - wall0) * self.speed))

    # ------------------------------------------------------------------------------------------ the driver protocol
    def done(self) -> bool:
        return self.stop_flag.is_set()

    def left(self) -> float:
        return IDLE_WAIT_S

    def on_idle(self, next_arrival_s: float | None) -> str | None:
        """Idle: jump to the next arrival (as fast as possible), or take its wall time at x; none to come: IDLE."""
        if next_arrival_s is None:
            return IDLE
        if self.speed is None:
            self.clock.advance_to(next_arrival_s)
            return None
        wall0, sim0 = self._anchor
        self.waiting_for = next_arrival_s
        try:
            self.sim._arrivals.sleep(max(0.0, wall0 + (next_arrival_s - sim0) / self.speed - time.monotonic()))
            self.clock.advance_to(self.paced_now())
        finally:
            self.waiting_for = None
        return None

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        sim, state, arrivals = self.sim, self.sim._loop, self.sim._arrivals
        try:
            with state.lock:
                arrivals.driver = self
            while not self.stop_flag.is_set():
                with state.lock:
                    ran = state.runner.steps_run
                    end = turn(state)
                    ran = state.runner.steps_run != ran
                    if end == IDLE:
                        self.idle.set()
                        arrivals.sleep(IDLE_WAIT_S)  # until a submission (the lock released meanwhile)
                if end == STOPPED:
                    with state.lock:
                        state.shutdown()
                    return
                if ran and self.speed is not None:
                    self._pace(self.clock.now)
                elif end is not None:
                    self._anchor = (time.monotonic(), self.clock.now)  # idle or held wall time is not simulated
        except BaseException as e:  # surfaced on the engine (state "dead", `error`); the requests end FAILED
            sim._die(e)
        finally:
            self.idle.set()
            with state.lock:
                if arrivals.driver is self:
                    arrivals.driver = None

    def _pace(self, now: float) -> None:
        wall0, sim0 = self._anchor
        lag = time.monotonic() - (wall0 + (now - sim0) / self.speed)
        if lag > MAX_LAG_S:
            self._anchor = (time.monotonic(), now)
        elif lag < 0:
            self.stop_flag.wait(-lag)
