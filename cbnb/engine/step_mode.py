"""Step-by-step mode, for teaching: `pause`, `step`, `resume` and the slow-motion cap `set_step_rate` (torch-free).

A mixin of `cbnb.engine.shell.EngineShell`, so `cbnb.Engine` and `cbnb.sim.SimEngine` have the same step mode. It keeps
the arguments' checks and the shared state (``self._loop.paused``, ``self._loop.step_rate``); how a loop holds and runs
one step is the engine's: three hooks, ``_wake()`` (the loop should look at the flags now), ``_hold(timeout) ->
bool`` (wait until the loop holds after its last applied step) and ``_one_step(timeout) -> int | None`` (run exactly
one scheduling step, then hold).

- `cbnb.Engine`: the loop side lives in `cbnb.engine.phases.LoopState.begin_turn()`, where every turn with no step in
  flight starts, in both step loops: while paused it keeps draining messages (submissions are admitted and wait
  PENDING; cancellations and reconfigures apply) and plans nothing, except exactly one step per `step()`; with a
  rate set, it plans at most that many steps per wall second. A stop overrides both.
- `cbnb.sim.SimEngine`: the same loop turns (`cbnb.engine.loop.turn`) on the caller's thread or the playback thread,
  so the same hold: while paused, a caller-driven wait (`run()`, `run_until()`, `generate()`, a handle's `result()`,
  the tuning lab's `run_workload`) holds as `generate()` holds on a paused engine, and `step()` from another thread
  (the dashboard's Step) runs one step in it; `resume()` lets it finish. With nobody driving, `step()` runs its
  step on the caller's thread. A single step with nothing due first moves the clock to the next arrival; the
  virtual clock stands while held. A rate paces the turns in wall seconds.

::

    engine.pause()                 # hold after the step now running
    h = engine.submit("Why is the sky blue?", max_new_tokens=8)   # PENDING, visibly queued
    engine.step()                  # one scheduling step: its StepPlanned event, then held again
    engine.set_step_rate(2)        # slow motion: at most 2 steps per second
    engine.resume()
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .handle import check_timeout
from .inbox import StepOnce

__all__ = ["StepMode", "LoopStepMode", "ThreadedStepMode", "check_step_rate"]


def check_step_rate(steps_per_s: object) -> float | None:
    """`steps_per_s` as a float in (0, 1000], or None (no cap; 0 means None too).

    Raises:
        ValueError: naming `steps_per_s`, for anything but None or a number in [0, 1000].
    """
    if steps_per_s is None:
        return None
    try:
        rate = float(steps_per_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"steps_per_s must be a number in [0, 1000] or None; got {steps_per_s!r}") from None
    if not (0 <= rate <= 1000) or isinstance(steps_per_s, bool):
        raise ValueError(f"steps_per_s must be a number in [0, 1000] or None; got {steps_per_s!r}")
    return rate or None


class StepMode:
    """The step-mode methods of an engine (see the module docstring)."""

    _loop: object

    def _wake(self) -> None:  # pragma: no cover - every engine overrides the three hooks
        raise NotImplementedError

    def _hold(self, timeout: float | None) -> bool:  # pragma: no cover
        raise NotImplementedError

    def _one_step(self, timeout: float | None) -> int | None:  # pragma: no cover
        raise NotImplementedError

    @property
    def paused(self) -> bool:
        """True while the step mode holds the loop (`pause()` or `step()`; `resume()` ends it)."""
        return self._loop.paused

    def pause(self, wait: bool = True, timeout: float | None = 30.0) -> bool:
        """Hold the loop after the step now running: no step is planned until `step()` or `resume()`. Submissions
        are still admitted (they wait PENDING), cancellations and reconfigures still apply. Also before `start()`:
        the loop then starts paused. `generate()` waits while paused.

        Args:
            wait: return once the loop holds (the last step applied); only while the engine is running.
            timeout: seconds `wait` waits at most (None: no limit).

        Returns:
            True when the loop holds (or will, at its start); False when `wait` timed out.
        """
        timeout = check_timeout(timeout)
        self._loop.paused = True
        self._wake()
        return self._hold(timeout) if wait else True

    def step(self, timeout: float | None = 60.0) -> int | None:
        """Run exactly one scheduling step (drain, plan, forward, apply), then hold again: the loop is paused
        afterwards whether it was before or not. Starts the engine if it was never started.

        Returns:
            the step's number (its `StepPlanned` event has it), or None when no request was waiting or running.

        Raises:
            TimeoutError: the step did not complete within `timeout` seconds (it still runs).
            EngineStoppedError: the engine is stopping, stopped, or dead.
        """
        timeout = check_timeout(timeout)
        self._loop.paused = True  # before the thread may start, so that it starts held
        return self._one_step(timeout)

    def resume(self) -> None:
        """End the step mode's pause: steps run freely again (at most `step_rate` per second when set)."""
        self._loop.paused = False
        self._wake()

    @property
    def step_rate(self) -> float | None:
        """Slow motion: steps per second at most, or None (no cap). Set it with `set_step_rate`."""
        return self._loop.step_rate

    def set_step_rate(self, steps_per_s: float | None) -> None:
        """Slow motion for teaching: plan at most `steps_per_s` steps per (wall) second (None or 0: no cap). Messages
        (submissions, cancellations, stop) are still handled at once between steps.

        Raises:
            ValueError: `steps_per_s` is not a number in [0, 1000].
        """
        self._loop.step_rate = check_step_rate(steps_per_s)
        self._wake()


class LoopStepMode:
    """The loop side of the step mode, a mixin of `cbnb.engine.phases.LoopState` (both engines' loop): the flags the
    API threads write, and what `begin_turn()` / `plan()` / `apply()` ask of them."""

    def _init_step_mode(self) -> None:
        self.paused = False
        self.step_rate: float | None = None  # steps per second at most (slow motion); None: no cap
        self.parked = threading.Event()  # set while the loop holds, paused, after the last step
        self._steps: deque[StepOnce] = deque()  # single steps asked for, not yet run (the loop's side only)
        self._stepping: StepOnce | None = None  # the single step being run
        self._next_step_t = 0.0  # time.monotonic() before which slow motion plans no step

    @property
    def gated(self) -> bool:
        """Whether the step mode may hold the next turn (the async loop then applies its step in flight first)."""
        return self.paused or bool(self.step_rate)

    def _hold(self) -> float | None:
        """Seconds to wait before the next step (paused, or slow motion), or None to go on now."""
        if self.inbox.stop_mode is not None or self.state == "dead":
            return None  # a stop runs to its end, paused or not
        if self._stepping is not None:
            return None  # a single step still looks for work (the simulator's: until the next arrival)
        if not self.paused:
            while self._steps:  # resumed with single steps still asked for: the loop runs anyway
                self._steps.popleft().done.set()
            if self.step_rate and self.core.has_work:
                left = self._next_step_t - time.monotonic()
                if left > 0:
                    return left
            return None
        if self._steps:
            self._stepping = self._steps.popleft()
            return None
        self.parked.set()
        return 0.5

    def _planned(self, step_id: int) -> None:
        """A step was planned: the slow-motion pace restarts, a single step learns its number."""
        if self.step_rate:
            self._next_step_t = time.monotonic() + 1.0 / self.step_rate
        if self._stepping is not None:
            self._stepping.step_id = step_id

    def _step_done(self) -> None:
        """The single step being run (if any) was applied, failed, or found nothing to schedule."""
        s, self._stepping = self._stepping, None
        if s is not None:
            s.done.set()

    def _end_steps(self) -> None:
        """The loop ends: every single step asked for is answered."""
        self._step_done()
        while self._steps:
            self._steps.popleft().done.set()


class ThreadedStepMode(StepMode):
    """The hooks for an engine whose loop is a `cbnb.engine.phases.LoopState` on its own thread (`cbnb.Engine`): the
    loop holds in `LoopState.begin_turn()`, and a single step is a `StepOnce` control message."""

    def _wake(self) -> None:
        self._loop.inbox.wakeup.set()

    def _hold(self, timeout: float | None) -> bool:
        loop = self._loop
        if loop.state == "running" and loop.thread is not threading.current_thread():
            return loop.parked.wait(timeout)
        return True

    def _one_step(self, timeout: float | None) -> int | None:
        self._ensure_running()
        msg = StepOnce()
        self._loop.inbox.control(msg)
        if not msg.done.wait(timeout):
            raise TimeoutError("the step did not complete in time")
        if msg.error is not None:
            raise msg.error
        return msg.step_id
