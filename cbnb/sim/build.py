"""`SimBuilder`: the simulator's parts for one config, as `cbnb.engine.build.EngineBuilder` builds the engine's
(torch-free): the cache sized from a hardware profile, the core, and the cost model as the runner.

`cbnb.engine.phases.LoopState` builds through it at construction and on every reconfigure (``install`` /
``rebuild``), so the simulator's parts change exactly as the engine's do. Sizing is the engine's sizing path
(`cbnb.core.cache.sizing.plan_memory`) on the profile's memory, less the weights (and on a CPU profile, the CPU
runner's packed copies of the float32 linear weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..core.cache.manager import CacheManager
from ..core.cache.sizing import MemoryPlan, plan_memory
from ..core.config import ContinuousBatchingConfig
from ..core.engine_core import EngineCore
from ..core.requests import Request
from .cost import CostModel
from .executor import SimExecutor

__all__ = ["SimBuilder", "SimParts"]

_UNLIMITED_HOST = 1 << 60


@dataclass
class SimParts:
    """What one config builds (the fields of `cbnb.engine.build.EngineParts`; no KV tensors)."""

    user_config: ContinuousBatchingConfig
    config: ContinuousBatchingConfig
    layout: Any
    memory: MemoryPlan
    cache: CacheManager
    store: None
    runner: SimExecutor
    core: EngineCore


class SimBuilder:
    """Builds `SimParts` for a `ModelShape` on a `HardwareProfile`, on the engine's virtual clock.

    Args:
        async_batching: override the resolved `use_async_batching` (None: keep it).
    """

    def __init__(self, shape: Any, profile: Any, clock: Any, async_batching: bool | None = None) -> None:
        self.shape, self.profile, self.clock, self.async_override = shape, profile, clock, async_batching
        self.weight_bytes = shape.weight_bytes()

    def plan_memory(self, config: ContinuousBatchingConfig) -> tuple[ContinuousBatchingConfig, MemoryPlan, int]:
        """Resolve `config` for the profile's device and size its cache, allocating nothing (as `Engine.plan_memory`).

        Returns:
            (resolved config with num_blocks filled in, the memory plan, host swap sectors).

        Raises:
            MemoryError: the weights, or the cache the config asks for, do not fit the profile's memory.
        """
        shape, profile = self.shape, self.profile
        free = profile.free_bytes(self.weight_bytes)
        if free <= 0:
            raise MemoryError(f"the weights of {shape.name} ({self.weight_bytes / 2**30:.2f} GiB in "
                              f"{shape.dtype}) do not fit profile {profile.name!r} "
                              f"({profile.memory_bytes / 2**30:.2f} GiB, "
                              f"{profile.reserved_bytes / 2**30:.2f} GiB reserved)")
        packed = 0
        if profile.runner == "cpu" and shape.dtype == "float32":
            packed = shape.linear_weight_bytes()  # the CPU runner's packed weight copies (as `Engine`'s sizing)
            free -= packed
        host = profile.host_memory_bytes if profile.host_memory_bytes is not None else _UNLIMITED_HOST
        resolved, _, memory, swap = plan_memory(
            config, shape.kv_spec(), shape.itemsize, device_type=profile.device_type,
            free_bytes=free, weight_bytes=self.weight_bytes, host_available_bytes=host,
            cuda_graphs_supported=profile.kind == "gpu", packed_weight_bytes=packed)
        return resolved, memory, swap

    def check(self, config: ContinuousBatchingConfig) -> None:
        """Refuse what cannot fit before anything changes (raises ValueError / MemoryError)."""
        self.plan_memory(config)

    def build(self, config: ContinuousBatchingConfig, *, sink: Callable[..., None] | None = None,
              on_terminal: Callable[[Request], None] | None = None) -> SimParts:
        resolved, memory, swap = self.plan_memory(config)
        layout = self.shape.layout(resolved.page_size)
        cache = CacheManager(layout, memory.num_sectors, allow_block_sharing=resolved.allow_block_sharing,
                             prefix_eviction=resolved.prefix_eviction, swap_sectors=swap, sink=sink)
        core = EngineCore(resolved, cache, on_terminal=on_terminal, clock=self.clock)
        core.kv_for_runner = False  # the cost model reads the plan's loads, not block tables
        core.measure_shared_reads = self.profile.runner == "cpu"  # the CPU decode kernel prices a shared prefix
        ov = self.async_override
        async_mode = bool(resolved.use_async_batching if ov is None else ov)
        executor = SimExecutor(CostModel(self.shape, self.profile, resolved), layout, self.clock, async_mode)
        executor.swap_sectors = swap  # (the host swap pool: `SimEngine.memory_split`)
        return SimParts(config, resolved, layout, memory, cache, None, executor, core)

    def empty_device_cache(self) -> None:
        pass
