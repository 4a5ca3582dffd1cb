"""Step-by-step mode, for teaching: `Engine.pause`, `step`, `resume` and the slow-motion cap `set_step_rate`.

A mixin of `cbnb.Engine` (it uses the engine's `_loop`, a `cbnb.phases.LoopState`, and `_ensure_running`). The loop
side lives in `LoopState.begin_turn()`, where every turn with no step in flight starts, in both step loops: while
paused it keeps draining messages (submissions are admitted and wait PENDING; cancellations and reconfigures apply)
and plans nothing, except exactly one step per `step()`; with a rate set, it plans at most that many steps per
second. A stop overrides both.

::

    engine.pause()                 # hold after the step now running
    h = engine.submit("Why is the sky blue?", max_new_tokens=8)   # PENDING, visibly queued
    engine.step()                  # one scheduling step: its StepPlanned event, then held again
    engine.set_step_rate(2)        # slow motion: at most 2 steps per second
    engine.resume()
"""

from __future__ import annotations

import threading

from .handle import check_timeout
from .inbox import StepOnce

__all__ = ["StepMode"]


class StepMode:
    """The step-mode methods of `cbnb.Engine` (see the module docstring)."""

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
        loop = self._loop
        loop.paused = True
        loop.inbox.wakeup.set()
        if wait and loop.state == "running" and loop.thread is not threading.current_thread():
            return loop.parked.wait(timeout)
        return True

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
        loop = self._loop
        loop.paused = True  # before the thread may start, so that it starts held
        self._ensure_running()
        msg = StepOnce()
        loop.inbox.control(msg)
        if not msg.done.wait(timeout):
            raise TimeoutError("the step did not complete in time")
        if msg.error is not None:
            raise msg.error
        return msg.step_id

    def resume(self) -> None:
        """End the step mode's pause: steps run freely again (at most `step_rate` per second when set)."""
        self._loop.paused = False
        self._loop.inbox.wakeup.set()

    @property
    def step_rate(self) -> float | None:
        """Slow motion: steps per second at most, or None (no cap). Set it with `set_step_rate`."""
        return self._loop.step_rate

    def set_step_rate(self, steps_per_s: float | None) -> None:
        """Slow motion for teaching: plan at most `steps_per_s` steps per second (None or 0: no cap). Messages
        (submissions, cancellations, stop) are still handled at once between steps.

        Raises:
            ValueError: `steps_per_s` is not a number in [0, 1000].
        """
        if steps_per_s is not None:
            try:
                rate = float(steps_per_s)
            except (TypeError, ValueError):
                raise ValueError(f"steps_per_s must be a number in [0, 1000] or None; got {steps_per_s!r}") from None
            if not (0 <= rate <= 1000) or isinstance(steps_per_s, bool):
                raise ValueError(f"steps_per_s must be a number in [0, 1000] or None; got {steps_per_s!r}")
            steps_per_s = rate or None
        self._loop.step_rate = steps_per_s
        self._loop.inbox.wakeup.set()
