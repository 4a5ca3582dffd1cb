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

Measuring this machine (`calibrate`, ``validate``, ``fit_vllm``, ``scale``) lives in `cbnb.measure`, above this
package; ``cbnb.sim.calibrate`` stays as a lazy alias of `cbnb.measure.calibrate` (loaded on first use, so importing
`cbnb.sim` never imports `cbnb.measure`). Imports without torch.
"""

from __future__ import annotations

from typing import Any

from .cost import CostModel, RowLoad, StepCost, StepLoad
from .engine import SIM_TOKEN, SimDevice, SimEngine, SimHandle, SimStep, SimulationStuck
from .profiles import PROFILE_NAMES, HardwareProfile, load_profile
from .shapes import SHAPE_NAMES, ModelShape, load_shape

__all__ = ["ModelShape", "load_shape", "SHAPE_NAMES", "HardwareProfile", "load_profile", "PROFILE_NAMES", "CostModel",
           "StepLoad", "RowLoad", "StepCost", "SimEngine", "SimStep", "SimHandle", "SimDevice", "SimulationStuck",
           "SIM_TOKEN"]


def __getattr__(name: str) -> Any:
    """``cbnb.sim.calibrate``: `cbnb.measure.calibrate`, imported on first use (a lazy alias: `cbnb.measure`
    imports this package)."""
    if name == "calibrate":
        from ..measure import calibrate

        return calibrate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
