"""`EngineBuilder`: sizes and builds an engine's parts for one model and device (cache manager, KV store, runner,
core), for `Engine.__init__` and for every `Engine.reconfigure`.

Sizing is `cbnb.core.cache.sizing.plan_memory` (the one sizing path, shared with the simulator) on the memory free
*now* (CUDA: `torch.cuda.mem_get_info`; CPU: `psutil` available RAM), so a rebuild frees the old pool before it
measures (`Engine.reconfigure`). The runner is the one `cbnb.runner.factory.make_runner` picks for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.cache.layout import KVLayout, layout_for, model_kv_spec
from ..core.cache.manager import CacheManager
from ..core.cache.sizing import MemoryPlan, plan_memory
from ..core.config import ContinuousBatchingConfig
from ..core.engine_core import EngineCore
from ..core.requests import Request
from ..runner.cpu import cpu_linear
from ..runner.factory import make_runner
from ..runner.kv import KVStore
from ..runner.model_runner import ModelRunner

__all__ = ["EngineBuilder", "EngineParts"]


@dataclass
class EngineParts:
    """What one config builds: the configs (as given, and resolved for this device), the cache geometry and
    memory plan, and the objects one engine step uses."""

    user_config: ContinuousBatchingConfig
    config: ContinuousBatchingConfig
    layout: KVLayout
    memory: MemoryPlan
    cache: CacheManager
    store: KVStore
    runner: ModelRunner
    core: EngineCore


def _host_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def free_memory(device: torch.device) -> int:
    """Bytes free for the cache on `device` (CUDA: after emptying torch's cache; CPU: available RAM)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


class EngineBuilder:
    """Builds `EngineParts` for `model` with its KV cache on `device` (default: the model's device).

    Raises:
        ValueError: for an unsupported model (attention types other than full/sliding).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None) -> None:
        self.model = model
        p = next(model.parameters())
        self.device = torch.device(device) if device is not None else p.device
        self.dtype = p.dtype
        self.itemsize = torch.tensor([], dtype=self.dtype).element_size()
        self.spec = model_kv_spec(model.config)
        text_cfg = getattr(model.config, "text_config", None) or model.config
        self.spec["intermediate_size"] = getattr(text_cfg, "intermediate_size", None)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        self.weight_bytes += sum(t.numel() * t.element_size() for t in model.buffers())

    def check(self, config: ContinuousBatchingConfig) -> None:
        """Cheap checks of `config` for this model, before anything changes (raises ValueError)."""
        layout_for(self.spec, self.itemsize, config.resolve(self.device.type).page_size)

    def plan_memory(self, config: ContinuousBatchingConfig) -> tuple[ContinuousBatchingConfig, MemoryPlan, int]:
        """Resolve `config` for this model and device and size its cache, allocating nothing.

        Returns:
            (resolved config with num_blocks filled in, the memory plan, host swap pool size in the pool's units).

        Raises:
            MemoryError: when the cache cannot be sized in the available memory.
        """
        free, packed = free_memory(self.device), 0
        if self.device.type == "cpu":
            pending = cpu_linear.bytes_to_pack(self.model)  # the packed weight copies the CPU runner will make
            free -= pending
            packed = cpu_linear.packed_bytes(self.model) + pending
        r, _, mp, swap = plan_memory(config, self.spec, self.itemsize, device_type=self.device.type,
                                     free_bytes=max(free, 0), weight_bytes=self.weight_bytes,
                                     packed_weight_bytes=packed,
                                     host_available_bytes=_host_available)
        return r, mp, swap

    def build(self, config: ContinuousBatchingConfig, *, sink: Callable[..., None] | None = None,
              on_terminal: Callable[[Request], None] | None = None) -> EngineParts:
        """Allocate the cache for `config` and build the parts (the runner is not activated)."""
        resolved, mp, swap = self.plan_memory(config)
        layout = layout_for(self.spec, self.itemsize, resolved.page_size)
        cache = CacheManager(layout, mp.num_sectors, allow_block_sharing=resolved.allow_block_sharing,
                             prefix_eviction=resolved.prefix_eviction, swap_sectors=swap, sink=sink)
        store = KVStore(layout, mp.num_sectors, self.device, self.dtype, swap_sectors=swap)
        core = EngineCore(resolved, cache, on_terminal=on_terminal)
        core.measure_shared_reads = self.device.type == "cpu"  # recorded for the simulator's CPU cost model
        runner = make_runner(self.model, cache.geometry(), store, seed=resolved.seed)
        return EngineParts(config, resolved, layout, mp, cache, store, runner, core)

    def empty_device_cache(self) -> None:
        """Hand freed device memory back (CUDA), so the next sizing sees it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def max_positions(self) -> int | None:
        return self.spec["max_position_embeddings"]
