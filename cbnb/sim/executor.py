"""`SimExecutor`: the simulator's executor, the cost model in the runner's place (torch-free).

What `cbnb.runner` is to `cbnb.Engine`, this is to `cbnb.sim.SimEngine`: the engine loop (`cbnb.engine.loop`) hands
it a step's `StepWork` through the runner's calls (``execute``, or ``launch`` / ``collect`` with async batching), and
it answers a `StepResult` (the placeholder token `SIM_TOKEN` for every sampled row, the predicted phase times, the
backend's name) after moving the virtual clock by the step's cost (`StepCost` from `cbnb.sim.cost.CostModel`):

- ``execute`` (synchronous batching): the clock goes to ``t0 + cost.total_s`` (``t0``: when planning began);
- ``launch`` / ``collect`` (async batching): two resources share the timeline, the host (planning, packing,
  applying: ``cost.host_s``) and the device (launched steps, in order: ``cost.device_s``). A launch moves the clock to
  ``t0 + host_s`` (the host is free again) and the device's end to ``max(launch, device free) + device_s``; a
  collect moves the clock to that end (when later).

Step timings reported to the recorder (`StepTiming`, ``stats()["run"]["time_by_phase_s"]``) are the predicted parts
in simulated seconds: ``prepare`` = the profile's per-step host overhead (scheduling, packing and update
included), ``forward`` = launches and the operator groups, ``sample`` = sampling, ``offload_copy`` = swap copies;
``schedule`` and ``update`` are 0 (they are inside ``prepare``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.plan import StepResult, StepWork
from .cost import CostModel, StepCost, StepLoad

__all__ = ["SimExecutor", "SimStep", "SIM_TOKEN"]

#: The token id every simulated sample produces (requests ignore EOS, so its value never ends a request).
SIM_TOKEN = 42


@dataclass(frozen=True)
class SimStep:
    """One simulated step: its virtual span (seconds) and the predicted cost."""

    step_id: int
    start_s: float
    end_s: float
    cost: StepCost


class SimExecutor:
    """The cost model as a step executor, with the runner's protocol (see the module docstring).

    Args:
        cost: the `CostModel` of the shape, profile and resolved config in use.
        layout: the cache's `KVLayout` (what a step's load is measured in).
        clock: the engine's `cbnb.sim.arrivals.VirtualClock`.
        async_mode: async batching (the loop calls ``launch`` / ``collect``).

    Attributes:
        steps: every executed step (`SimStep`), in order of application; kept across a reconfigure (`inherit`).
        steps_run: steps executed (launched, with async batching).
        schedule_wall_s: host seconds this process spent in `EngineCore.schedule()` (the simulator's own cost).
    """

    configured = True
    supports_prompt_logprobs = False

    def __init__(self, cost: CostModel, layout: Any, clock: Any, async_mode: bool = False) -> None:
        self.cost = cost
        self.layout = layout
        self.clock = clock
        self.async_mode = async_mode
        self.active = False
        self.steps: list[SimStep] = []
        self.steps_run = 0
        self.schedule_wall_s = 0.0
        self._device_free = 0.0
        self._last_end = 0.0

    # ------------------------------------------------------------------------------------------ the runner's life
    def configure(self, config: Any) -> None:
        pass

    def activate(self) -> None:
        self.active = True

    def deactivate(self) -> None:
        self.active = False

    def release(self) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def inherit(self, previous: "SimExecutor") -> None:
        """Take over the previous parts' timeline (a reconfigure): steps, counters, the device's next free time."""
        self.steps, self.steps_run, self.schedule_wall_s = previous.steps, previous.steps_run, previous.schedule_wall_s
        self._device_free, self._last_end = previous._device_free, previous._last_end

    # ------------------------------------------------------------------------------------------ steps
    def price(self, work: StepWork) -> StepCost:
        """The predicted cost of a step (seconds)."""
        return self.cost.step(StepLoad.from_work(work, self.layout))

    def _begin(self, work: StepWork) -> StepCost:
        self.schedule_wall_s += work.schedule_s
        work.schedule_s = 0.0  # host seconds of this process; the simulated scheduling is in the step's host part
        self.steps_run += 1
        return self.price(work)

    def execute(self, work: StepWork) -> StepResult:
        cost = self._begin(work)
        self.clock.now = work.t0 + cost.total_s
        return self._done(work, cost)

    def launch(self, work: StepWork) -> tuple[StepWork, StepCost, float]:
        cost = self._begin(work)
        launched = work.t0 + cost.host_s
        device_end = max(launched, self._device_free) + cost.device_s
        self._device_free = device_end
        self.clock.now = launched
        return work, cost, device_end

    def collect(self, handle: tuple[StepWork, StepCost, float]) -> StepResult:
        work, cost, device_end = handle
        self.clock.advance_to(device_end)
        return self._done(work, cost)

    def _done(self, work: StepWork, cost: StepCost) -> StepResult:
        now = self.clock.now
        self.steps.append(SimStep(work.step_id, max(work.t0, self._last_end), now, cost))
        self._last_end = now
        return self.result(work, cost)

    def result(self, work: StepWork, cost: StepCost) -> StepResult:
        """What the step produced: `SIM_TOKEN` for every request that samples, and the predicted phase times."""
        tokens = {s.request_id: SIM_TOKEN for s in work.plan.scheduled if s.samples}
        parts = cost.parts
        timings = {"offload_copy": parts.get("swap", 0.0), "prepare": cost.host_s,
                   "forward": cost.total_s - cost.host_s - parts.get("sample", 0.0) - parts.get("swap", 0.0),
                   "sample": parts.get("sample", 0.0)}
        backend = f"sim-{self.cost.profile.runner}-{'graph' if cost.graph else 'eager'}"
        return StepResult(tokens, timings, backend=backend)
