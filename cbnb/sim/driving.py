"""How a `SimEngine` runs: on the caller's thread (`run`, `run_until`, a handle's wait) or on a playback thread
(`start`, `stop`, `speed`), and what happens when it cannot go on (torch-free).

A mixin of `cbnb.sim.SimEngine` (it uses the engine's `_loop`, a `cbnb.sim.loop.VirtualLoop`, and `_present`,
`_playback`, `_state`). Every turn runs under the loop's lock, so API calls from other threads land between turns,
as they land between the real engine's loop turns. While the step mode holds (`pause()`), no turn runs: the
caller-driven calls that wait for requests to end raise `SimulationPaused` (nothing else would run the next step),
`run_until(t)` lets the clock stand while arrivals due are admitted, and the playback thread waits.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

from ..engine.handle import RequestHandle, check_timeout
from ..core.requests import Request, RequestOutput, RequestState
from ._gc import relaxed_gc
from .loop import SimulationStuck
from .playback import Playback, check_speed

__all__ = ["SimDriving", "SimHandle", "SimulationPaused"]


class SimulationPaused(RuntimeError):
    """A caller-driven wait on a paused simulation: `step()` runs one step, `resume()` lets it run."""


class SimHandle(RequestHandle):
    """`cbnb.RequestHandle` of a simulated request. On an engine with no playback thread (caller-driven), waiting
    on it runs the simulation on the caller's thread: `result()` until this request has ended, iteration until its
    next tokens (`async for` until it has ended)."""

    def __init__(self, request: Request, sim: Any) -> None:
        super().__init__(request, None, sim.cancel)
        self._drive = weakref.WeakMethod(sim._drive_until)

    def _run_until(self, cond: Callable[[], bool]) -> None:
        drive = self._drive()
        if drive is not None and not cond():
            drive(cond)

    def result(self, timeout: float | None = None) -> RequestOutput:
        self._run_until(self.done)
        return super().result(timeout)

    def _before_wait(self) -> None:
        q = self._q
        self._run_until(lambda: not q.empty() or self.done())

    async def __aiter__(self):
        self._run_until(self.done)
        async for d in super().__aiter__():
            yield d


class SimDriving:
    """The running half of `SimEngine` (see the module docstring)."""

    _loop: Any
    _playback: Playback | None
    _present: float
    _state: str
    error: BaseException | None
    wall_s: float

    # ------------------------------------------------------------------------------------------ caller-driven
    def _check_caller_driven(self) -> None:
        if self._playback is not None:
            raise RuntimeError("the simulation runs on its playback thread: call stop() before run()/run_until()")
        if self._state == "dead":
            raise RuntimeError(f"the simulation died: {self.error!r}")

    def _drive(self, until: Callable[[], bool], horizon: float | None = None, max_steps: int | None = None) -> None:
        """Run turns (caller's thread) until `until()`, the clock reaches `horizon`, or `max_steps` steps ran."""
        self._check_caller_driven()
        w0 = time.perf_counter()
        try:
            with relaxed_gc():
                self._turns(until, horizon, max_steps)
        except SimulationStuck as e:
            self._die(e)
            raise
        finally:
            self.wall_s += time.perf_counter() - w0
            self._present = max(self._present, self._loop.now if horizon is None else horizon)

    def _turns(self, until: Callable[[], bool], horizon: float | None, max_steps: int | None) -> None:
        loop = self._loop
        first = loop.steps_run
        while not until():
            if max_steps is not None and loop.steps_run - first >= max_steps:
                return
            if horizon is not None and loop.now >= horizon:
                return
            with loop.lock:
                if loop.paused:
                    self._held(horizon)
                    return
                if loop.turn():
                    continue
                nxt = loop.next_arrival_s  # idle: nothing can run before the next arrival
                if nxt is None:
                    if horizon is not None:
                        loop.idle_until(horizon)
                    return
                loop.idle_until(nxt if horizon is None else min(nxt, horizon))

    def _held(self, horizon: float | None) -> None:
        """The step mode holds: apply the step in flight, admit what is due; no step runs."""
        loop = self._loop
        loop.finish_inflight()
        loop.admit_due()
        if horizon is None:
            raise SimulationPaused("the simulation is paused: sim.step() runs one step, sim.resume() lets it run")

    def _drive_until(self, done: Callable[[], bool]) -> None:
        if self._playback is None and self._state != "dead":
            self._drive(done)

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        """Run until every submitted request has ended, arrivals included (or `max_steps` more steps ran).
        Returns `stats()`.

        Raises:
            SimulationStuck: a step scheduled nothing while requests wait and nothing is in flight.
            SimulationPaused: the step mode holds (`pause()`): `step()` or `resume()` first.
            RuntimeError: while the playback thread runs.
        """
        loop = self._loop
        self._drive(lambda: not loop.busy, max_steps=max_steps)
        with loop.lock:
            loop.finish_inflight()
            self._present = max(self._present, loop.now)
        return self.stats()

    def run_until(self, t: float) -> dict[str, Any]:
        """Run until the virtual clock reaches `t` simulated seconds: every step that starts before `t` runs (the
        last may end after it); idle time passes up to `t`. A step in flight (async batching) stays in flight, so
        running in pieces makes the same decisions as one `run()`. While paused, no step runs (the clock stands).
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
        return self._state

    @property
    def running(self) -> bool:
        return self._state == "running"

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
            if self._state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            if self._playback is not None:
                self._playback.set_speed(speed)
                return self
            self._playback = Playback(self, speed)
            self._state = "running"
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
            self._present = max(self._present, self._loop.now)
            if self._state == "running":
                self._state = "stopped"

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the playback thread has nothing left to do (every submitted request ended). False on timeout.
        Without a playback thread: run the simulation (`run()`) and return True."""
        pb = self._playback
        if pb is None:
            self.run()
            return True
        return pb.idle.wait(check_timeout(timeout))

    def _die(self, error: BaseException) -> None:
        """The simulation cannot go on: every unfinished request ends FAILED with the reason."""
        loop = self._loop
        with loop.lock:
            self.error = error
            self._state = "dead"
            reason = f"simulation died: {type(error).__name__}: {error}"
            if loop.core is not None:
                loop.core.fail_all(reason)
            for req in loop.take_arrivals():
                self._end_unadmitted(req, RequestState.FAILED, "error", reason)
            loop.recorder.flush()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ step mode hooks
    def _wake(self) -> None:
        pb = self._playback
        if pb is not None:
            pb.wake.set()

    def _hold(self, timeout: float | None) -> bool:
        pb = self._playback
        if pb is not None:
            return pb.parked.wait(timeout)
        with self._loop.lock:  # caller-driven: nothing runs between calls; apply a step in flight
            self._loop.finish_inflight()
        return True

    def _one_step(self, timeout: float | None) -> int | None:
        if not self._loop.lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("the step did not complete in time")
        try:
            if self._state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            try:
                sid = self._loop.one_step()
            except SimulationStuck as e:
                self._die(e)
                raise
            self._present = max(self._present, self._loop.now)
            return sid
        finally:
            self._loop.lock.release()

    def sim_stats(self) -> dict[str, Any]:
        """The simulation itself: simulated seconds, steps, host seconds spent (and of those in the scheduler)."""
        loop = self._loop
        return {"sim_time_s": loop.now, "steps": len(loop.steps), "wall_s": self.wall_s,
                "schedule_wall_s": loop.schedule_wall_s, "async_batching": self.async_batching,
                "num_blocks": self.config.num_blocks, "profile": self.profile.name, "shape": self.shape.name,
                "arrivals_pending": loop.num_arrivals}
