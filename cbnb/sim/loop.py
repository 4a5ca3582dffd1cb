"""`VirtualLoop`: the engine loop's turns on a virtual clock, for `cbnb.sim.SimEngine` (torch-free).

A turn is what `cbnb.engine.phases.LoopState` does in one turn of `cbnb.engine.loop.sync_loop` / `async_loop`, in the
same order and through the same `cbnb.telemetry.recorder.Recorder` calls, with the runner replaced by the `CostModel`:

- **admit**: the requests whose arrival time has come (at most `MAX_SUBMISSIONS_PER_TURN` per turn, as the inbox
  hands them to the engine loop) go to `EngineCore.add`;
- **plan**: `EngineCore.schedule()` (the recorder, the core's observer, records its StepPlanned);
- **execute**: the step's predicted cost advances the clock (``now += cost.total_s``) instead of a forward;
- **apply**: `EngineCore.apply` with the token `SIM_TOKEN` for every sampled row, the tokens to the handles,
  `Recorder.step_done`, then the turn's events to the log (`Recorder.flush`).

With async batching the turn is `async_loop`'s: step N+1 is planned and launched before step N is collected and
applied, admissions happen only with no step in flight (a due arrival first collects the step in flight, as the
engine's loop finishes its step when the inbox has messages), and two resources share the virtual timeline: the host
(planning, packing, applying: ``cost.host_s``) and the device (launched steps, in order: ``cost.device_s``).

The step's tokens and predicted times come from the executor (`cbnb.sim.executor.SimExecutor`, the cost model in the
runner's place); the clock is virtual (`now`, simulated seconds).

**Step mode** (`cbnb.engine.step_mode`): `one_step()` runs exactly one planning turn and applies its step, also with
async batching (a step in flight is applied before the loop holds, as the engine's loop does while `gated`). While
`paused`, the engine (`cbnb.sim.SimEngine`) runs no other turn.
"""

from __future__ import annotations

import heapq
from collections import deque
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.handle import HandleTable
from ..engine.inbox import MAX_SUBMISSIONS_PER_TURN
from ..core.plan import StepWork
from ..core.requests import Request
from ..telemetry.recorder import Recorder
from .cost import StepCost
from .executor import SIM_TOKEN, SimExecutor

__all__ = ["VirtualLoop", "SimStep", "SIM_TOKEN", "SimulationStuck"]


class SimulationStuck(RuntimeError):
    """A step scheduled nothing while requests wait and nothing is in flight (the real engine would spin forever)."""


@dataclass(frozen=True)
class SimStep:
    """One simulated step: its virtual span (seconds) and the predicted cost."""

    step_id: int
    start_s: float
    end_s: float
    cost: StepCost


class VirtualLoop:
    """The loop state of one simulated engine (see the module docstring).

    Args:
        recorder: the engine's `Recorder` (its clock must read `now`).
        deliver: ``deliver(request, token_ids)`` for each request that received a token and is not terminal.

    Attributes:
        now: the virtual clock (seconds).
        lock: held by every turn and by the engine's API calls that change state (`cbnb.engine.shell.EngineShell`).
        handles: the live request handles (`HandleTable`).
        paused, step_rate: the step mode (`cbnb.engine.step_mode`).
        core, cache, layout, executor, async_batching: the parts in use (set by `install`).
        steps: every executed step (`SimStep`), in order of application.
        schedule_wall_s: host seconds spent in `EngineCore.schedule()` (the simulator's own cost).
    """

    def __init__(self, recorder: Recorder, deliver: Callable[[Request, list[int]], None]) -> None:
        self.recorder = recorder
        self.deliver = deliver
        self.now = 0.0
        self.lock = threading.RLock()
        self.handles = HandleTable()
        self.recent: deque[Request] = deque(maxlen=256)  # the most recently ended requests
        self.paused = False
        self.step_rate: float | None = None
        self.last_planned: int | None = None  # the step id of the last `StepPlanned` (a single step's answer)
        self.core: Any = None
        self.cache: Any = None
        self.layout: Any = None
        self.executor: SimExecutor | None = None
        self.async_batching = False
        self.steps: list[SimStep] = []
        self.steps_run = 0  # steps executed (launched, with async batching)
        self.schedule_wall_s = 0.0
        self._arrivals: list[tuple[float, int, Request]] = []  # heap of (arrival_s, seq, request)
        self._seq = itertools.count()
        self._inflight: tuple[StepWork, StepCost, float, float] | None = None  # (work, cost, t0, device end)
        self._device_free = 0.0
        self._last_end = 0.0

    def install(self, core: Any, cache: Any, layout: Any, executor: SimExecutor, async_batching: bool) -> None:
        self.core, self.cache, self.layout, self.executor = core, cache, layout, executor
        self.async_batching = async_batching
        self.recorder.attach(core, cache)

    @property
    def cost(self) -> Any:
        """The `CostModel` in use."""
        return self.executor.cost

    # ------------------------------------------------------------------------------------------ arrivals
    def add_arrival(self, req: Request, arrival_s: float) -> None:
        """Queue a request that reaches the engine at `arrival_s` (>= now)."""
        heapq.heappush(self._arrivals, (arrival_s, next(self._seq), req))

    def remove_arrival(self, request_id: str) -> Request | None:
        """Take a request that has not arrived yet out of the queue (None when it is not there)."""
        for i, (_, _, req) in enumerate(self._arrivals):
            if req.request_id == request_id:
                self._arrivals[i] = self._arrivals[-1]
                self._arrivals.pop()
                heapq.heapify(self._arrivals)
                return req
        return None

    def take_arrivals(self) -> list[Request]:
        """Every request not arrived yet, in arrival order (the queue is left empty)."""
        out = [r for _, _, r in sorted(self._arrivals)]
        self._arrivals.clear()
        return out

    @property
    def num_arrivals(self) -> int:
        return len(self._arrivals)

    @property
    def next_arrival_s(self) -> float | None:
        return self._arrivals[0][0] if self._arrivals else None

    def _due(self) -> bool:
        return bool(self._arrivals) and self._arrivals[0][0] <= self.now

    def due(self) -> list[Request]:
        """Requests whose arrival time has come but that no turn has admitted yet, in arrival order."""
        return [r for t, _, r in sorted(self._arrivals) if t <= self.now]

    def arrival_of(self, request_id: str) -> float | None:
        """When a queued request arrives (simulated seconds), None when it is not queued."""
        return next((t for t, _, r in self._arrivals if r.request_id == request_id), None)

    def admit_due(self) -> None:
        """Admit the requests whose arrival time has come (what a paused loop still does)."""
        self._admit_due()
        self.recorder.flush()

    def _admit_due(self) -> None:
        arr, core = self._arrivals, self.core
        n = 0
        while arr and arr[0][0] <= self.now and n < MAX_SUBMISSIONS_PER_TURN:
            core.add(heapq.heappop(arr)[2])
            n += 1

    # ------------------------------------------------------------------------------------------ turns
    @property
    def busy(self) -> bool:
        """Work the loop can do now or later: unfinished requests, a step in flight, or arrivals to come."""
        return bool(self.core.has_work or self._inflight is not None or self._arrivals)

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def turn(self) -> bool:
        """One loop turn. Returns False when nothing can run before the next arrival (the loop is idle).

        Raises:
            SimulationStuck: a step scheduled nothing while requests wait and nothing is in flight.
        """
        try:
            return self._turn_async() if self.async_batching else self._turn_sync()
        finally:
            self.recorder.flush()

    def idle_until(self, t: float) -> None:
        """Let the clock run idle to `t` (never backwards)."""
        if t > self.now:
            self.now = t

    def one_step(self) -> int | None:
        """Exactly one planning turn, its step applied (the step mode's `step()`). With nothing due and nothing to
        run, the clock first moves to the next arrival. Returns the planned step's id, None when nothing waited."""
        self.finish_inflight()
        if not self.core.has_work and not self._due() and self._arrivals:
            self.idle_until(self._arrivals[0][0])
        self.last_planned = None
        try:
            self.turn()
        finally:
            self.finish_inflight()
        return self.last_planned

    def finish_inflight(self) -> None:
        """Collect and apply the step in flight (async batching), if any."""
        if self._inflight is not None:
            self._collect()
        self.recorder.flush()

    def _plan(self) -> tuple[StepWork, float]:
        work = self.core.schedule()  # the recorder hears the plan as the core's observer
        t0 = work.t0
        self.last_planned = work.step_id
        self.schedule_wall_s += work.schedule_s
        work.schedule_s = 0.0  # host seconds of this process; the simulated scheduling is in the step's host part
        return work, t0

    def _stuck(self, work: StepWork) -> SimulationStuck:
        waiting = list(self.core.scheduler.waiting)[:5]
        return SimulationStuck(f"simulation made no progress at step {work.step_id}: nothing scheduled and nothing in "
                               f"flight, {len(self.core.requests)} requests unfinished (waiting: {waiting})")

    def _turn_sync(self) -> bool:
        self._admit_due()
        if not self.core.has_work:
            return False
        work, t0 = self._plan()
        if work.empty and not work.swap_outs:
            if work.failed or work.offloads:
                return True  # progress without a forward (the engine's loop turns over the same way)
            raise self._stuck(work)
        cost = self.executor.price(work)
        self.steps_run += 1
        self.now = t0 + cost.total_s
        self._apply(work, cost, t0)
        return True

    def _turn_async(self) -> bool:
        if self._inflight is not None and self._due():
            self._collect()  # the engine finishes its step before it drains the inbox
        if self._inflight is None:
            self._admit_due()
        if not self.core.has_work:
            if self._inflight is None:
                return False
            self._collect()
            return True
        work, t0 = self._plan()
        if work.empty and not work.swap_outs:
            if self._inflight is None:
                if work.failed or work.offloads:
                    return True
                raise self._stuck(work)
            self._collect()  # what blocks scheduling may be the step in flight: apply it, retry
            return True
        cost = self.executor.price(work)
        self.steps_run += 1
        launched = t0 + cost.host_s
        device_end = max(launched, self._device_free) + cost.device_s
        self._device_free = device_end
        self.now = launched
        if self._inflight is not None:
            self._collect()
        self._inflight = (work, cost, t0, device_end)
        return True

    def _collect(self) -> None:
        work, cost, t0, device_end = self._inflight
        self._inflight = None
        self.now = max(self.now, device_end)
        self._apply(work, cost, t0)

    def _apply(self, work: StepWork, cost: StepCost, t0: float) -> None:
        result = self.executor.result(work, cost)
        now = self.now
        deliver = self.deliver
        for req in self.core.apply(work, result.tokens):
            if not req.is_terminal:
                deliver(req, req.output_ids[-1:])
        start = max(t0, self._last_end)
        self.recorder.step_done(work, result, start, now, now)
        self._last_end = now
        self.steps.append(SimStep(work.step_id, start, now, cost))
