"""`cbnb.sim`: what-if simulation of cbnb's own scheduler and cache on hardware you do not have (torch-free).

- `ModelShape` / `load_shape`: a model's architecture without weights (bundled shapes, config.json, HF cache);
- `HardwareProfile` / `load_profile`: a device's memory, FLOP/s, bandwidths and overheads (datasheet GPUs, and
  ``cpu`` measured here by `calibrate()`);
- `CostModel`: seconds per step from the step's plan (a per-operator roofline plus overheads);
- `SimEngine`: the real `cbnb.core.engine_core.EngineCore` on a virtual clock, costed by the `CostModel`, with
  `cbnb.Engine`'s read API, events and statistics (so `cbnb.ui.Dashboard(sim)` works); caller-driven (`run`,
  `run_until`) or on a playback thread (`start(speed=...)`).

- the tuning lab (`cbnb.lab.tuning`: run_workload, sweep, best; the Runs panel) takes a `SimEngine` (its virtual
  `driver_clock`, `cbnb.sim.clock`); `cbnb.sim.heatmap` plots a sweep's figure over two config fields and
  `cbnb.sim.compare` a simulated run against a measured one (plotly only when a figure is drawn).

`calibrate()` measures this machine (it uses torch when installed); everything else imports without torch.
"""

from __future__ import annotations

from .calibrate import calibrate  # the function, bound after the submodule loads (so it never shadows it)
from .cost import CostModel, RowLoad, StepCost, StepLoad
from .engine import SIM_TOKEN, SimDevice, SimEngine, SimHandle, SimStep, SimulationStuck
from .profiles import PROFILE_NAMES, HardwareProfile, load_profile
from .shapes import SHAPE_NAMES, ModelShape, load_shape

__all__ = ["ModelShape", "load_shape", "SHAPE_NAMES", "HardwareProfile", "load_profile", "PROFILE_NAMES", "CostModel",
           "StepLoad", "RowLoad", "StepCost", "SimEngine", "SimStep", "SimHandle", "SimDevice", "SimulationStuck",
           "SIM_TOKEN", "calibrate"]

