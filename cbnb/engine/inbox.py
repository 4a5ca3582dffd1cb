"""The inbox: what API threads ask of the engine loop (torch-free, thread-safe).

Four kinds of message, each with its own channel so that a flood of one never starves the others:

- **submissions** (FIFO): new requests. The loop takes at most `max_per_turn` per turn, so steps keep running
  while a thread submits in a tight loop; and a submitter that finds `high_water` submissions still untaken waits
  (up to `MAX_WAIT_S`) for the loop to take some: without that back-pressure a producer thread holding the GIL
  queues hundreds of thousands of requests while the loop runs a few steps, and `stop()` must then end them all.
- **cancellations** (a set of request ids): all applied every turn, and again right before a step's tokens are
  applied, so a cancel that lands while the step is in flight still wins (see `cbnb.engine.phases.LoopState`).
- **controls** (FIFO, all taken every turn): `Reconfigure`, `StepOnce` (one step of a paused loop).
- **stop**: a mode ("drain" or "cancel") read by the loop every turn, never queued behind submissions.

`request_stop()` closes the inbox to new submissions at once: every `submit` after `stop()` began raises
`EngineStoppedError`, while everything submitted before it is still taken by the loop (and ends with a terminal
output). `close()` (the loop's last act) refuses everything and hands back the submissions never taken.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["EngineStoppedError", "Inbox", "Reconfigure", "StepOnce", "MAX_SUBMISSIONS_PER_TURN"]

#: Submissions the loop admits per turn at most (transformers' default `max_requests_per_batch`).
MAX_SUBMISSIONS_PER_TURN = 1024
#: Untaken submissions above which `submit` waits for the loop (four turns' worth).
HIGH_WATER = 4 * MAX_SUBMISSIONS_PER_TURN
#: The longest a submitter waits for room (then it queues anyway: back-pressure never loses nor deadlocks).
MAX_WAIT_S = 0.5


class EngineStoppedError(RuntimeError):
    """Raised when work is submitted to an engine that is stopping, was stopped, or died."""


@dataclass
class Reconfigure:
    """Ask the loop to rebuild with `config`; `done` is set once applied (`error` holds what it raised)."""

    config: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class StepOnce:
    """Ask a paused loop for exactly one scheduling step; `done` is set once it was applied (or when there was nothing
    to schedule), with `step_id` the step planned (None when no request was waiting or running)."""

    done: threading.Event = field(default_factory=threading.Event)
    step_id: int | None = None
    error: BaseException | None = None


class Inbox:
    """The channels described in the module docstring.

    Args:
        max_per_turn: submissions taken per `take_submissions()` call at most.
        high_water: untaken submissions above which `submit(wait=True)` waits for room (0: never waits).
    """

    def __init__(self, max_per_turn: int = MAX_SUBMISSIONS_PER_TURN, high_water: int = HIGH_WATER) -> None:
        self.max_per_turn = max_per_turn
        self.high_water = high_water
        self.wakeup = threading.Event()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when the loop takes submissions or the inbox closes
        self._submissions: deque = deque()
        self._controls: deque = deque()
        self._cancels: set[str] = set()
        self._closed: str | None = None  # why submissions are refused (None: open)
        self.stop_mode: str | None = None  # None, "drain" or "cancel"

    # ---------------------------------------------------------------- API threads
    def submit(self, item: Any, register: Callable[[], None] | None = None, wait: bool = True) -> None:
        """Queue a submission; `register()` runs first, atomically with the check that the inbox is open.

        With `wait` (any thread but the loop's), a submitter finding `high_water` submissions untaken first waits up
        to `MAX_WAIT_S` for the loop to take some (the loop's pace, not the producer's, sets the queue's length).

        Raises:
            EngineStoppedError: the inbox is closed (its message says why).
        """
        with self._lock:
            if wait and self.high_water and len(self._submissions) >= self.high_water and self._closed is None:
                self.wakeup.set()
                self._room.wait_for(lambda: len(self._submissions) < self.high_water or self._closed is not None,
                                    MAX_WAIT_S)
            if self._closed is not None:
                raise EngineStoppedError(self._closed)
            if register is not None:
                register()
            self._submissions.append(item)
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
        self.wakeup.set()

    def control(self, msg: Any) -> None:
        with self._lock:
            self._controls.append(msg)
        self.wakeup.set()

    def request_stop(self, drain: bool, reason: str = "engine is stopping") -> None:
        """Refuse new submissions from now on and ask the loop to stop (a "cancel" stop overrides a "drain" one)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            if self.stop_mode != "cancel":
                self.stop_mode = "drain" if drain else "cancel"
            self._room.notify_all()
        self.wakeup.set()

    # ---------------------------------------------------------------- the loop
    def take_submissions(self) -> list[Any]:
        """Up to `max_per_turn` submissions, oldest first (the wakeup stays set when more are waiting)."""
        with self._lock:
            n = min(len(self._submissions), self.max_per_turn)
            out = [self._submissions.popleft() for _ in range(n)]
            more = bool(self._submissions)
            if n:
                self._room.notify_all()
        if more:
            self.wakeup.set()
        return out

    def untaken(self, limit: int = 256) -> list[Any]:
        """A copy of the oldest `limit` submissions the loop has not taken yet, without those already cancelled
        (any thread: what a snapshot shows as PENDING before the loop's next turn)."""
        with self._lock:
            out = list(itertools.islice(self._submissions, limit))
            cancels = set(self._cancels)
        return [x for x in out if getattr(x, "request_id", None) not in cancels]

    def take_cancels(self) -> set[str]:
        with self._lock:
            out, self._cancels = self._cancels, set()
        return out

    def keep_cancel(self, request_id: str) -> None:
        """Put back a cancellation whose submission is still queued (it applies once the request is admitted)."""
        with self._lock:
            self._cancels.add(request_id)

    def take_controls(self) -> list[Any]:
        with self._lock:
            out = list(self._controls)
            self._controls.clear()
        return out

    def has_submissions(self) -> bool:
        return bool(self._submissions)

    def pending(self) -> bool:
        """Anything the loop must look at before its next step: messages, or a cancelling stop."""
        return bool(self._submissions or self._controls or self._cancels) or self.stop_mode == "cancel"

    # ---------------------------------------------------------------- how the loop waits (the thread's clock)
    def hold(self, wait: float) -> bool:
        """The step mode holds: wait up to `wait` seconds for a message. True: the loop keeps holding (a thread
        never hands its turn back; the simulator's inbox, `cbnb.sim.arrivals`, may)."""
        if not self.pending():
            self.wakeup.wait(wait)
        return True

    def idle(self, wait: float, blocked: Any) -> str | None:
        """Nothing to run now (`blocked`: the step that scheduled nothing, or None when no request is left): wait up
        to `wait` seconds for a message. Returns None (the loop goes on); the simulator's inbox moves its clock."""
        if not self.pending():
            self.wakeup.wait(wait)
        return None

    def upcoming(self) -> bool:
        """Whether a submission will reach the loop without any caller's help (a thread's inbox: never)."""
        return False

    def close(self, reason: str) -> tuple[list[Any], list[Any]]:
        """Refuse everything from now on (`EngineStoppedError(reason)`); return (submissions never taken, controls
        never taken)."""
        with self._lock:
            self._closed = reason
            self._room.notify_all()
            subs, ctrls = list(self._submissions), list(self._controls)
            self._submissions.clear()
            self._controls.clear()
            self._cancels.clear()
        return subs, ctrls

    def reopen(self) -> None:
        """Accept submissions again (`Engine.start` after a stop)."""
        with self._lock:
            self._closed = None
            self.stop_mode = None
            self._cancels.clear()
        self.wakeup.clear()

    @property
    def closed(self) -> str | None:
        """Why submissions are refused, or None while they are accepted."""
        return self._closed
