"""`Playback`: a `SimEngine` on its own thread, as fast as possible or paced at ``speed`` x simulated time (torch-free).

The thread runs the virtual loop's turns (`cbnb.sim.loop.VirtualLoop.turn`) under the engine's lock, one turn at a
time, so API calls from other threads (submit, cancel, reconfigure, the dashboard's reads) land between turns, as
they land between the real engine's loop turns. Pacing:

- ``speed=None``: no waiting; when nothing can run before the next arrival, the clock jumps to it;
- ``speed=x``: after each turn the thread sleeps until the wall clock has caught up with ``x`` simulated seconds per
  wall second (idle gaps before an arrival included), so a dashboard's panels animate; when the simulation cannot
  keep up (a turn costs more host time than its simulated span / x), it runs flat out and the pace restarts from
  where it is (no burst to catch up).

With no request left and none to come, the thread waits for a submission; the virtual clock does not advance while
it waits. The step mode (`cbnb.engine.step_mode`): while paused the thread applies its step in flight, admits the
arrivals that are due and waits (`parked` is set; the clock stands still); `SimEngine.step()` runs one step on the
caller's thread meanwhile. With a step rate, the thread waits 1/rate wall seconds after each turn that ran (slow
motion).
"""

from __future__ import annotations

import threading
import time
from typing import Any

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
    """The thread of one `SimEngine` (see the module docstring).

    Args:
        sim: the engine (its `_lock`, `_loop`, `_die`).
        speed: simulated seconds per wall second, or None.
    """

    def __init__(self, sim: Any, speed: float | None) -> None:
        self.sim = sim
        self.speed = speed
        self.stop_flag = threading.Event()
        self.wake = threading.Event()
        self.idle = threading.Event()  # set while nothing is left to do
        self.parked = threading.Event()  # set while the step mode holds the thread
        self.waiting_for: float | None = None  # the arrival (simulated s) an idle wait is pacing towards
        self._anchor = (time.monotonic(), 0.0)
        self.thread = threading.Thread(target=self._run, name="cbnb-sim", daemon=True)

    def start(self) -> None:
        self._anchor = (time.monotonic(), self.sim._loop.now)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.stop_flag.set()
        self.wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def set_speed(self, speed: float | None) -> None:
        self.speed = speed
        self._anchor = (time.monotonic(), self.sim._loop.now)
        self.wake.set()

    def paced_now(self) -> float:
        """The simulated time now: the loop's clock, or during an idle wait for an arrival, where the pace is."""
        loop = self.sim._loop
        target = self.waiting_for
        if target is None or self.speed is None:
            return loop.now
        wall0, sim0 = self._anchor
        return max(loop.now, min(target, sim0 + (time.monotonic() - wall0) * self.speed))

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        sim, loop = self.sim, self.sim._loop
        try:
            while not self.stop_flag.is_set():
                if loop.paused:
                    self._park()
                    continue
                self.parked.clear()
                with sim._lock:
                    ran = loop.turn()
                    nxt = None if ran else loop.next_arrival_s
                    if not ran and nxt is None:
                        self.idle.set()
                if ran:
                    self._pace(loop.now)
                    if loop.step_rate:
                        self.wake.wait(1.0 / loop.step_rate)
                        self.wake.clear()
                        self._anchor = (time.monotonic(), loop.now)  # slow motion is not simulated time
                elif nxt is None:
                    self.wake.wait(IDLE_WAIT_S)
                    self.wake.clear()
                    self._anchor = (time.monotonic(), loop.now)  # idle wall time is not simulated time
                elif self.speed is None:
                    with sim._lock:
                        loop.idle_until(nxt)
                else:
                    self._idle_towards(nxt)
        except BaseException as e:  # surfaced on the engine (state "dead", `error`); the requests end FAILED
            sim._die(e)
        finally:
            self.idle.set()

    def _park(self) -> None:
        """Hold for the step mode: the last step applied, arrivals due admitted, then wait for a change."""
        loop = self.sim._loop
        with self.sim._lock:
            if not loop.paused:
                return
            loop.finish_inflight()
            loop.admit_due()
        self.parked.set()
        self.wake.wait(IDLE_WAIT_S)
        self.wake.clear()
        self._anchor = (time.monotonic(), loop.now)  # held wall time is not simulated time

    def _pace(self, now: float) -> None:
        if self.speed is None:
            return
        wall0, sim0 = self._anchor
        lag = time.monotonic() - (wall0 + (now - sim0) / self.speed)
        if lag > MAX_LAG_S:
            self._anchor = (time.monotonic(), now)
        elif lag < 0:
            self.stop_flag.wait(-lag)

    def _idle_towards(self, nxt: float) -> None:
        wall0, sim0 = self._anchor
        self.waiting_for = nxt
        try:
            self.wake.wait(max(0.0, wall0 + (nxt - sim0) / self.speed - time.monotonic()))
            self.wake.clear()
            with self.sim._lock:
                self.sim._loop.idle_until(self.paced_now())
        finally:
            self.waiting_for = None
