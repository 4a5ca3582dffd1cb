"""`Arrivals`: the simulator's inbox, which releases requests by simulated time, and its `VirtualClock` (torch-free).

The engine loop (`cbnb.engine.loop`, phases in `cbnb.engine.phases.LoopState`) takes its messages from an inbox. A
thread's (`cbnb.engine.inbox.Inbox`) holds what API threads sent; this one holds the simulated requests by arrival
time: `take_submissions()` hands the loop those whose time has come, oldest first, at most
`MAX_SUBMISSIONS_PER_TURN` per turn (as the thread's inbox); control messages (`StepOnce`) queue as there. What
waiting means differs, and is asked of whoever runs the turns (the `driver`, `cbnb.sim.driving`):

- **idle** (no request to run now): the driver moves the clock to the next arrival (bounded by `run_until`'s
  horizon; on a playback thread at x speed, after the wall time that span takes at x), or, with no arrival to come,
  the turn returns IDLE to it. A plan that scheduled nothing while requests wait and nothing is in flight is
  progress when it failed or offloaded requests, else `SimulationStuck` (the real engine would spin forever);
- **hold** (the step mode): the turn waits for a message on a condition of the loop's lock (released meanwhile, so
  other threads' calls land: the dashboard's Step and Resume), until the driver is done (its condition, deadline or
  stop flag): then the turn returns HELD.

A driver has ``done() -> bool``, ``left() -> float`` (wall seconds a hold may wait before it looks at ``done()``
again) and ``on_idle(next_arrival_s) -> str | None``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from typing import Any

from ..core.requests import Request
from ..engine.inbox import MAX_SUBMISSIONS_PER_TURN
from ..engine.phases import IDLE

__all__ = ["Arrivals", "VirtualClock", "SimulationStuck"]


class SimulationStuck(RuntimeError):
    """A step scheduled nothing while requests wait and nothing is in flight (the real engine would spin forever)."""


class VirtualClock:
    """Simulated seconds: ``clock()`` reads `now`; executors and drivers move it."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Let the clock run to `t` (never backwards)."""
        if t > self.now:
            self.now = t


class Arrivals:
    """The simulator's inbox (see the module docstring).

    Args:
        clock: the engine's `VirtualClock`.
        lock: the loop's lock (a hold waits on a condition of it).
    """

    def __init__(self, clock: VirtualClock, lock: Any, max_per_turn: int = MAX_SUBMISSIONS_PER_TURN) -> None:
        self.clock = clock
        self.max_per_turn = max_per_turn
        self.wakeup = threading.Event()  # (the thread inbox's flag, cleared by a drain; holds wait on `_cond`)
        self.driver: Any = None
        self.state: Any = None  # the `LoopState` (what a stuck simulation reports)
        self.stop_mode: str | None = None
        self._cond = threading.Condition(lock)
        self._woken = False
        self._heap: list[tuple[float, int, Request]] = []  # (arrival_s, seq, request)
        self._seq = itertools.count()
        self._controls: deque = deque()
        self._closed: str | None = None

    # ------------------------------------------------------------------------------------------ API side
    def add(self, req: Request, arrival_s: float) -> None:
        """Queue a request that reaches the engine at `arrival_s` (>= now)."""
        heapq.heappush(self._heap, (arrival_s, next(self._seq), req))

    def remove(self, request_id: str) -> Request | None:
        """Take a request that has not arrived yet out of the queue (None when it is not there)."""
        heap = self._heap
        for i, (_, _, req) in enumerate(heap):
            if req.request_id == request_id:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                return req
        return None

    def arrival_of(self, request_id: str) -> float | None:
        """When a queued request arrives (simulated seconds), None when it is not queued."""
        return next((t for t, _, r in self._heap if r.request_id == request_id), None)

    def due(self) -> list[Request]:
        """Requests whose arrival time has come but that no turn has taken yet, in arrival order."""
        now = self.clock.now
        return [r for t, _, r in sorted(self._heap) if t <= now]

    @property
    def next_arrival_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def control(self, msg: Any) -> None:
        with self._cond:
            self._controls.append(msg)
        self.wake()

    def wake(self) -> None:
        """The loop should look at its messages and flags now (a hold ends its wait)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def sleep(self, seconds: float) -> None:
        """Wait up to `seconds` wall seconds or until `wake()`, the loop's lock released meanwhile (the caller
        holds it)."""
        with self._cond:
            if not self._woken and seconds > 0:
                self._cond.wait(seconds)
            self._woken = False

    # ------------------------------------------------------------------------------------------ the loop's side
    def take_submissions(self) -> list[Request]:
        heap, now = self._heap, self.clock.now
        out = []
        while heap and heap[0][0] <= now and len(out) < self.max_per_turn:
            out.append(heapq.heappop(heap)[2])
        return out

    def take_controls(self) -> list[Any]:
        out = list(self._controls)
        self._controls.clear()
        return out

    def take_cancels(self) -> tuple[()]:
        return ()  # `SimEngine.cancel` applies at once, under the lock, between turns

    def keep_cancel(self, request_id: str) -> None:  # pragma: no cover - no cancellation is ever queued here
        pass

    def has_submissions(self) -> bool:
        return bool(self._heap)

    def pending(self) -> bool:
        """Anything the loop must look at before its next step: a control message, or an arrival that is due."""
        heap = self._heap
        return bool(self._controls) or bool(heap and heap[0][0] <= self.clock.now)

    def upcoming(self) -> bool:
        """Whether a request will arrive without any caller's help (one is queued for later)."""
        return bool(self._heap)

    def untaken(self) -> list[Request]:
        return self.due()

    def hold(self, wait: float) -> bool:
        """The step mode holds: wait for a message (lock released). False: the driver is done (HELD)."""
        d = self.driver
        if d is None or d.done():
            return False
        if not self.pending():
            self.sleep(min(wait, d.left()))
        return not d.done()

    def idle(self, wait: float, blocked: Any) -> str | None:
        """Nothing to run now: see the module docstring (`blocked`: the plan that scheduled nothing, or None)."""
        if blocked is not None:
            if blocked.failed or blocked.offloads:
                return None  # progress without a forward (the engine's loop turns over the same way)
            core = self.state.core
            waiting = list(core.scheduler.waiting)[:5]
            raise SimulationStuck(f"simulation made no progress at step {blocked.step_id}: nothing scheduled and "
                                  f"nothing in flight, {len(core.requests)} requests unfinished (waiting: {waiting})")
        d = self.driver
        return IDLE if d is None else d.on_idle(self.next_arrival_s)

    def close(self, reason: str) -> tuple[list[Request], list[Any]]:
        """The simulation died: every request yet to arrive and every control message, handed back."""
        self._closed = reason
        subs = [r for _, _, r in sorted(self._heap)]
        self._heap.clear()
        return subs, self.take_controls()

    @property
    def closed(self) -> str | None:
        return self._closed
