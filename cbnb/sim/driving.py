"""How a `SimEngine` runs: the engine loop's own turns (`cbnb.engine.loop.turn`), on the caller's thread (`run`,
`run_until`, a handle's wait, `step`) or on a playback thread (`start`, `stop`, `speed`) (torch-free).

A mixin of `cbnb.sim.SimEngine` (it uses the engine's `_loop`, a `cbnb.engine.phases.LoopState`, its inbox
`_arrivals` and clock `_clock`, and `_present`, `_playback`). Every turn runs under the loop's lock, so API calls
from other threads land between turns, as they land between the real engine's loop turns. One thread drives at a
time; it tells the inbox when it is done (`cbnb.sim.arrivals`: its condition, the clock's horizon, a step count, a
deadline) and how idle time passes (the clock jumps to the next arrival).

The step mode is the loop's (`cbnb.engine.step_mode`): while paused, a caller-driven wait (`run()`, `run_until(t)`,
`generate()`, a handle's `result()`) holds, as `generate()` holds on a paused real engine: the loop still admits
what arrives, and `step()` from another thread (the dashboard's Step) runs one step there; `resume()` lets it finish.
`step()` with nobody driving runs its one step on the caller's thread.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

from ..core.requests import Request, RequestOutput
from ..engine.handle import RequestHandle, check_timeout
from ..engine.inbox import StepOnce
from ..engine.loop import turn
from ..engine.phases import IDLE, REBUILT
from ._gc import relaxed_gc
from .arrivals import SimulationStuck
from .playback import Playback, check_speed

__all__ = ["SimDriving", "SimHandle"]

HOLD_CHECK_S = 0.5  # a held caller looks at its own end (condition, deadline) at least this often


class SimHandle(RequestHandle):
    """`cbnb.RequestHandle` of a simulated request. On an engine with no playback thread (caller-driven), waiting
    on it runs the simulation on the caller's thread: `result()` until this request has ended, iteration until its
    next tokens (`async for` until it has ended)."""

    def __init__(self, request: Request, sim: Any) -> None:
        super().__init__(request, None, sim.cancel)
        self._drive = weakref.WeakMethod(sim._drive_until)

    def _run_until(self, cond: Callable[[], bool], timeout: float | None = None) -> None:
        drive = self._drive()
        if drive is not None and not cond():
            drive(cond, timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        timeout = check_timeout(timeout)
        t0 = time.monotonic()
        self._run_until(self.done, timeout)
        return super().result(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))

    def _before_wait(self) -> None:
        q = self._q
        self._run_until(lambda: not q.empty() or self.done())

    async def __aiter__(self):
        self._run_until(self.done)
        async for d in super().__aiter__():
            yield d


class _CallerDrive:
    """The caller's thread runs turns until `until()`, the clock reaches `horizon`, `max_steps` steps ran, or the
    `deadline` (time.monotonic()) passed (the driver protocol of `cbnb.sim.arrivals`)."""

    def __init__(self, sim: Any, until: Callable[[], bool], horizon: float | None, max_steps: int | None,
                 deadline: float | None) -> None:
        self.until, self.horizon, self.deadline = until, horizon, deadline
        self.clock, self.state = sim._clock, sim._loop
        self.last_step = None if max_steps is None else sim._loop.runner.steps_run + max_steps

    def done(self) -> bool:
        if self.until():
            return True
        if self.horizon is not None and self.clock.now >= self.horizon:
            return True
        if self.last_step is not None and self.state.runner.steps_run >= self.last_step:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def left(self) -> float:
        return HOLD_CHECK_S if self.deadline is None else max(0.0, min(HOLD_CHECK_S, self.deadline - time.monotonic()))

    def on_idle(self, next_arrival_s: float | None) -> str | None:
        """Idle: the clock jumps to the next arrival (or to the horizon, when sooner); nothing to come: IDLE."""
        h = self.horizon
        if next_arrival_s is None:
            if h is not None:
                self.clock.advance_to(h)
            return IDLE
        self.clock.advance_to(next_arrival_s if h is None else min(next_arrival_s, h))
        return None


class SimDriving:
    """The running half of `SimEngine` (see the module docstring)."""

    _loop: Any
    _arrivals: Any
    _clock: Any
    _playback: Playback | None
    _present: float
    wall_s: float

    # ------------------------------------------------------------------------------------------ caller-driven
    def _check_caller_driven(self) -> None:
        if self._playback is not None:
            raise RuntimeError("the simulation runs on its playback thread: call stop() before run()/run_until()")
        if self._loop.state == "dead":
            raise RuntimeError(f"the simulation died: {self.error!r}")

    def _drive(self, until: Callable[[], bool], horizon: float | None = None, max_steps: int | None = None,
               timeout: float | None = None) -> None:
        """Run the loop's turns on this thread until `until()`, the clock reaches `horizon`, `max_steps` more steps
        ran, or `timeout` wall seconds passed (another thread driving: wait for it to let go)."""
        self._check_caller_driven()
        d = _CallerDrive(self, until, horizon, max_steps, None if timeout is None else time.monotonic() + timeout)
        driving = self._driving
        while not driving.acquire(timeout=0.05):
            if d.done():
                return
        state, arrivals = self._loop, self._arrivals
        w0 = time.perf_counter()
        try:
            with relaxed_gc():
                arrivals.driver = d
                while not d.done():
                    with state.lock:
                        end = turn(state)
                    if end is not None and end != REBUILT:
                        break
        except SimulationStuck as e:
            self._die(e)
            raise
        finally:
            arrivals.driver = None
            driving.release()
            with state.lock:
                state.recorder.flush()
                self.wall_s += time.perf_counter() - w0
                self._present = max(self._present, self._clock.now if horizon is None else horizon)

    def _drive_until(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        if self._playback is None and self._loop.state != "dead":
            self._drive(done, timeout=timeout)

    @property
    def _busy(self) -> bool:
        """Work the loop can do now or later: unfinished requests, a step in flight, or arrivals to come."""
        state = self._loop
        return bool(state.core.has_work or state.inflight is not None or len(self._arrivals))

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        """Run until every submitted request has ended, arrivals included (or `max_steps` more steps ran).
        While paused it holds (as `generate()` on a paused engine): `step()` from another thread (the dashboard)
        runs one step, `resume()` lets it finish. Returns `stats()`.

        Raises:
            SimulationStuck: a step scheduled nothing while requests wait and nothing is in flight.
            RuntimeError: while the playback thread runs.
        """
        self._drive(lambda: not self._busy, max_steps=max_steps)
        state = self._loop
        with state.lock:
            if state.inflight is not None:
                state.finish()
            state.recorder.flush()
            self._present = max(self._present, self._clock.now)
        return self.stats()

    def run_until(self, t: float) -> dict[str, Any]:
        """Run until the virtual clock reaches `t` simulated seconds: every step that starts before `t` runs (the
        last may end after it); idle time passes up to `t`. A step in flight (async batching) stays in flight, so
        running in pieces makes the same decisions as one `run()`. While paused it holds, as `run()` does.
        Returns `stats()`.

        Raises:
            ValueError: `t` is not a finite number.
        """
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not abs(t) < float("inf"):
            raise ValueError(f"t must be a finite number of simulated seconds; got {t!r}")
        self._drive(lambda: False, horizon=float(t))
        return self.stats()

    # ------------------------------------------------------------------------------------------ playback thread
    @property
    def state(self) -> str:
        """"created" (never started), "running" (playback thread), "stopped" (requests kept: `run()` or `start()`
        go on), or "dead" (see `error`)."""
        return self._loop.state

    @property
    def running(self) -> bool:
        return self._loop.state == "running"

    @property
    def error(self) -> BaseException | None:
        """What killed the simulation (state "dead"), else None."""
        return self._loop.error

    @property
    def speed(self) -> float | None:
        """Simulated seconds per wall second of the playback thread (None: as fast as possible). Settable."""
        return self._playback.speed if self._playback is not None else None

    @speed.setter
    def speed(self, speed: float | None) -> None:
        speed = check_speed(speed)
        if self._playback is not None:
            self._playback.set_speed(speed)

    def start(self, speed: float | None = None) -> Any:
        """Run on a playback thread: as fast as possible (None), or at `speed` x simulated time. No-op (except
        for the speed) when running.

        Raises:
            ValueError: a `speed` that is not None or a number > 0. RuntimeError: the simulation died.
        """
        speed = check_speed(speed)
        with self._loop.lock:
            if self._loop.state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            if self._playback is not None:
                self._playback.set_speed(speed)
                return self
            self._playback = Playback(self, speed)
            self._loop.state = "running"
            self._playback.start()
        return self

    def stop(self, timeout: float | None = 10.0, *, drain: bool = False) -> None:
        """Stop the playback thread after its current turn. Unfinished requests are kept (`run()` or `start()`
        continue the simulation). `drain` (as `Engine.stop`): first let every submitted request end (playback: up
        to `timeout` wall seconds; caller-driven: `run()`)."""
        pb = self._playback
        if drain:
            self.wait_idle(timeout)
        if pb is None:
            return
        pb.stop(timeout)
        with self._loop.lock:
            self._playback = None
            self._present = max(self._present, self._clock.now)
            if self._loop.state == "running":
                self._loop.state = "stopped"

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the playback thread has nothing left to do (every submitted request ended). False on timeout.
        Without a playback thread: run the simulation (`run()`) and return True."""
        pb = self._playback
        if pb is None:
            self.run()
            return True
        return pb.idle.wait(check_timeout(timeout))

    def _die(self, error: BaseException) -> None:
        """The simulation cannot go on: the loop's end (`LoopState.shutdown`), every unfinished request FAILED."""
        state = self._loop
        with state.lock:
            state.die(error, f"{type(error).__name__}: {error}")
            state.shutdown()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ step mode hooks
    def _wake(self) -> None:
        self._arrivals.wake()

    def _driven_elsewhere(self) -> bool:
        return self._playback is not None or (self._driving.locked() and self._arrivals.driver is not None)

    def _hold(self, timeout: float | None) -> bool:
        if self._driven_elsewhere():
            return self._loop.parked.wait(timeout)
        state = self._loop
        with state.lock:  # caller-driven: nothing runs between calls; apply a step in flight
            if state.inflight is not None:
                state.finish()
            state.recorder.flush()
        return True

    def _one_step(self, timeout: float | None) -> int | None:
        if self._loop.state == "dead":
            raise RuntimeError(f"the simulation died: {self.error!r}")
        msg = StepOnce()
        self._arrivals.control(msg)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not msg.done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("the step did not complete in time")
            if self._driven_elsewhere():
                msg.done.wait(0.05 if left is None else min(0.05, left))
            else:
                self._drive(msg.done.is_set, timeout=left)
        if msg.error is not None:
            raise msg.error
        with self._loop.lock:
            self._present = max(self._present, self._clock.now)
        return msg.step_id

    def sim_stats(self) -> dict[str, Any]:
        """The simulation itself: simulated seconds, steps, host seconds spent (and of those in the scheduler)."""
        ex = self._loop.runner
        return {"sim_time_s": self._clock.now, "steps": len(ex.steps), "wall_s": self.wall_s,
                "schedule_wall_s": ex.schedule_wall_s, "async_batching": self.async_batching,
                "num_blocks": self.config.num_blocks, "profile": self.profile.name, "shape": self.shape.name,
                "arrivals_pending": len(self._arrivals)}

