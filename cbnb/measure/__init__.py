"""`cbnb.measure`: measuring this machine and checking the simulator against it (apart from the simulator itself).

- `calibrate()` (`cbnb.measure.calibrate`): the ``cpu`` `cbnb.sim.HardwareProfile` of this machine, from
  microbenchmarks of the ops the CPU runner runs (torch back-end `_torch`, `_torch_kernels`, `_torch_fit`; NumPy
  back-end `_numpy` without torch) and end-to-end engine runs;
- ``python -m cbnb.measure.validate``: the simulator's predictions against the real engine on this machine;
- `cbnb.measure.fit_vllm.fit_profile`: a GPU profile fitted to your own ``vllm bench serve`` results;
- ``python -m cbnb.measure.scale``: how long this machine takes to simulate production traffic;
- `cbnb.measure.rates`: the GEMM and memory-bandwidth probes of the bench's roofline floor.

Depends on `cbnb.sim` (shapes, profiles, cost model, `SimEngine`), the engine and the lab's driver; nothing below it
imports it (``cbnb.sim.calibrate``, ``cbnb.sim.validate``, ``cbnb.sim.scale`` and ``cbnb.sim.fit_vllm`` are lazy
aliases kept for old code). Imports without torch; `calibrate` uses torch when installed.
"""

from __future__ import annotations

from .calibrate import calibrate  # the function, bound after the submodule loads (so it never shadows it)

__all__ = ["calibrate"]
