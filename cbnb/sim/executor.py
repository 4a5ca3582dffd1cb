"""`SimExecutor`: the simulator's executor, the cost model in the runner's place (torch-free).

What `cbnb.runner` is to `cbnb.Engine`, this is to `cbnb.sim.SimEngine`: given a step's `StepWork` it says what
the step produced (a `StepResult`: the placeholder token `SIM_TOKEN` for every sampled row, the predicted phase
times, the backend's name) and what it cost (`StepCost`: host and device seconds, from `cbnb.sim.cost.CostModel`).
The virtual loop (`cbnb.sim.loop`) advances its clock by that cost.

Step timings reported to the recorder (`StepTiming`, ``stats()["run"]["time_by_phase_s"]``) are the predicted parts
in simulated seconds: ``prepare`` = the profile's per-step host overhead (scheduling, packing and update
included), ``forward`` = launches and the operator groups, ``sample`` = sampling, ``offload_copy`` = swap copies;
``schedule`` and ``update`` are 0 (they are inside ``prepare``).
"""

from __future__ import annotations

from typing import Any

from ..core.plan import StepResult, StepWork
from .cost import CostModel, StepCost, StepLoad

__all__ = ["SimExecutor", "SIM_TOKEN"]

#: The token id every simulated sample produces (requests ignore EOS, so its value never ends a request).
SIM_TOKEN = 42


class SimExecutor:
    """The cost model as a step executor.

    Args:
        cost: the `CostModel` of the shape, profile and resolved config in use.
        layout: the cache's `KVLayout` (what a step's load is measured in).
    """

    def __init__(self, cost: CostModel, layout: Any) -> None:
        self.cost = cost
        self.layout = layout

    def price(self, work: StepWork) -> StepCost:
        """The predicted cost of a step (seconds)."""
        return self.cost.step(StepLoad.from_work(work, self.layout))

    def result(self, work: StepWork, cost: StepCost) -> StepResult:
        """What the step produced: `SIM_TOKEN` for every request that samples, and the predicted phase times."""
        tokens = {s.request_id: SIM_TOKEN for s in work.plan.scheduled if s.samples}
        parts = cost.parts
        timings = {"offload_copy": parts.get("swap", 0.0), "prepare": cost.host_s,
                   "forward": cost.total_s - cost.host_s - parts.get("sample", 0.0) - parts.get("swap", 0.0),
                   "sample": parts.get("sample", 0.0)}
        backend = f"sim-{self.cost.profile.runner}-{'graph' if cost.graph else 'eager'}"
        return StepResult(tokens, timings, backend=backend)
