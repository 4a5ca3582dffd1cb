"""`SimEngine`: cbnb's own core on a virtual clock, costed by `CostModel` instead of a model forward (torch-free).

The decisions are cbnb's by construction: `SimEngine` drives the real `cbnb.core.EngineCore` (the same schedulers,
cache manager, prefix index, offload policy), sizes the cache with the same sizing code
(`cbnb.cache.sizing.plan_memory`) from the profile's memory, `max_memory_percent` and the weights' bytes, and follows
the engine loop step for step:

- synchronous: ``schedule -> (copies, forward, sample) -> apply``; the clock advances by the step's predicted time;
- async batching (a GPU profile with CUDA graphs, or ``async_batching=True``): step N+1 is scheduled and launched
  before step N is applied, exactly as `cbnb.Engine`'s async loop; the host part of step N+1 overlaps the device part
  of step N on the virtual timeline.

Every sample is the token `SIM_TOKEN` and requests ignore EOS (as the standard workloads do), so a request generates
exactly its `max_new_tokens`. Requests, their state changes and token times carry virtual seconds (the core's clock).

Skeleton status (issue 13, phase 1): requests are submitted before `run()` (token ids only). Arrival times and the
driver come with the tuning lab's driver and run log (issue 12); the events and stats will come from the shared,
torch-free telemetry recorder that `cbnb.Engine` uses (issue 10). Until then `events` holds StepPlanned and Offload
records and `stats()` the real `RunStats` fed with virtual times.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..cache.manager import CacheManager
from ..cache.sizing import MemoryPlan, plan_memory
from ..cache.snapshot import KVSnapshot, kv_snapshot, kv_usage
from ..config import ContinuousBatchingConfig
from ..core import EngineCore, StepWork
from ..events import Event, EventLog, Offload, StepPlanned
from ..requests import Request, RequestOutput, SamplingParams
from ..stats import RunStats
from .cost import CostModel, StepCost, StepLoad
from .profiles import HardwareProfile, load_profile
from .shapes import ModelShape, load_shape

__all__ = ["SimEngine", "SimStep", "SIM_TOKEN"]

#: The token id every simulated sample produces (requests ignore EOS, so its value never ends a request).
SIM_TOKEN = 42
_UNLIMITED_HOST = 1 << 60


@dataclass(frozen=True)
class SimStep:
    """One simulated step: its virtual span (seconds) and the predicted cost."""

    step_id: int
    start_s: float
    end_s: float
    cost: StepCost


class SimEngine:
    """Simulate cbnb serving a model shape on a hardware profile.

    Args:
        shape: a `ModelShape` or anything `load_shape` takes ("llama-3.1-8b", a config.json, a transformers config).
        profile: a `HardwareProfile` or anything `load_profile` takes ("h100-sxm", "cpu", a JSON path).
        config: a `ContinuousBatchingConfig` (default: transformers' defaults), resolved for the profile's device.
        dtype: weights/KV dtype (default: the shape's).
        async_batching: override the resolved `use_async_batching` (None: keep it).
        telemetry: record `events`.
        event_log_size: events retained.

    Raises:
        ValueError: an unknown shape or profile (named), or a bad config value.
        MemoryError: the weights or the configured cache do not fit the profile's memory.
    """

    def __init__(self, shape: Any, profile: Any, config: ContinuousBatchingConfig | None = None, *,
                 dtype: Any = None, async_batching: bool | None = None, telemetry: bool = True,
                 event_log_size: int = 100_000) -> None:
        self.shape: ModelShape = load_shape(shape, dtype=dtype)
        self.profile: HardwareProfile = load_profile(profile)
        if config is not None and not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        self.user_config = config or ContinuousBatchingConfig()
        self.weight_bytes = self.shape.weight_bytes()
        resolved, memory, swap = self.plan_memory(self.user_config)
        layout = self.shape.layout(resolved.page_size)
        self.config: ContinuousBatchingConfig = resolved
        self.layout = layout
        self.memory: MemoryPlan = memory
        self.swap_sectors = swap
        self.async_batching = bool(resolved.use_async_batching if async_batching is None else async_batching)
        self.max_positions = self.shape.max_position_embeddings
        self.telemetry = bool(telemetry)
        self.events = EventLog(event_log_size)
        # TODO(issue 10): the shared telemetry recorder becomes the cache's `sink` (cache events) and records
        # StepPlanned/Offload/StepTiming and the stats exactly as cbnb.Engine does; `_plan_event` below goes then.
        self.cache = CacheManager(layout, memory.num_sectors, allow_block_sharing=resolved.allow_block_sharing,
                                  prefix_eviction=resolved.prefix_eviction, swap_sectors=swap, sink=None)
        self.now = 0.0  # the virtual clock (seconds)
        self.core = EngineCore(resolved, self.cache, on_terminal=self._on_terminal, clock=self._clock)
        self.cost = CostModel(self.shape, self.profile, resolved)
        self.steps: list[SimStep] = []
        self._stats = RunStats()
        self._kv_sample_t: float | None = None
        self._outputs: dict[str, RequestOutput] = {}
        self._order: list[str] = []
        self._recent: "collections.deque[RequestOutput]" = collections.deque(maxlen=256)
        self._ids = itertools.count()
        self.wall_s = 0.0  # host seconds spent simulating
        self.schedule_wall_s = 0.0  # of which in the core's schedule()

    def _clock(self) -> float:
        return self.now

    def plan_memory(self, config: ContinuousBatchingConfig) -> tuple[ContinuousBatchingConfig, MemoryPlan, int]:
        """Resolve `config` for the profile's device and size its cache, allocating nothing (as `Engine.plan_memory`).

        Returns:
            (resolved config with num_blocks filled in, the memory plan, host swap sectors).

        Raises:
            MemoryError: the weights, or the cache the config asks for, do not fit the profile's memory.
        """
        free = self.profile.free_bytes(self.weight_bytes)
        if free <= 0:
            raise MemoryError(f"the weights of {self.shape.name} ({self.weight_bytes / 2**30:.2f} GiB in "
                              f"{self.shape.dtype}) do not fit profile {self.profile.name!r} "
                              f"({self.profile.memory_bytes / 2**30:.2f} GiB, "
                              f"{self.profile.reserved_bytes / 2**30:.2f} GiB reserved)")
        host = self.profile.host_memory_bytes if self.profile.host_memory_bytes is not None else _UNLIMITED_HOST
        resolved, _, memory, swap = plan_memory(
            config, self.shape.kv_spec(), self.shape.itemsize, device_type=self.profile.device_type,
            free_bytes=free, weight_bytes=self.weight_bytes, host_available_bytes=host,
            cuda_graphs_supported=self.profile.kind == "gpu")
        return resolved, memory, swap

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None,
               request_id: str | None = None) -> str:
        """Queue one request (token ids). Returns its request id.

        Raises:
            ValueError: an empty prompt, ids outside [0, vocab_size), a duplicate id, or no room to generate within
                the model's max positions (same rules as `cbnb.Engine.submit`).
        """
        # TODO(issue 12): arrival times and the driver; until then every request arrives at the current time.
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("prompt must contain at least one token; got an empty prompt")
        bad = [i for i in ids if i < 0 or i >= self.shape.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.shape.vocab_size})")
        cap = None
        if self.max_positions:
            cap = self.max_positions - len(ids)
            if cap < 1:
                raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate: the model's max positions "
                                 f"are {self.max_positions}")
            if max_new_tokens is not None and max_new_tokens > cap:
                max_new_tokens = cap
        rid = request_id if request_id is not None else f"sim-{next(self._ids)}"
        if rid in self.core.requests or rid in self._outputs:
            raise ValueError(f"request_id {rid!r} is already in use")
        sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        req = Request(rid, ids, sp, max_new_tokens_cap=cap, now=self.now)
        self._order.append(rid)
        self.core.add(req)
        return rid

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int | Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Submit every prompt, run to completion, return one `RequestOutput` per prompt (input order)."""
        prompts = list(prompts)
        ns = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        if len(ns) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(ns)} entries for {len(prompts)} prompts")
        rids = [self.submit(p, n) for p, n in zip(prompts, ns)]
        self.run()
        return [self._outputs[r] for r in rids]

    def outputs(self) -> list[RequestOutput]:
        """Terminal outputs of every request submitted so far that has ended, in submission order."""
        return [self._outputs[r] for r in self._order if r in self._outputs]

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any non-terminal state (blocks freed at once). False when unknown or already ended."""
        return self.core.cancel(request_id) is not None

    def _on_terminal(self, req: Request) -> None:
        self._stats.on_done(req)
        out = req.output()
        self._outputs[req.request_id] = out
        self._recent.append(out)

    # ------------------------------------------------------------------------------------------ the loop
    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        """Run until every submitted request is terminal (or `max_steps` steps ran). Returns `stats()`.

        Raises:
            RuntimeError: when a step schedules nothing while requests wait and nothing is in flight (the real
                engine would wait forever for a submission that cannot come).
        """
        w0 = time.perf_counter()
        try:
            if self.async_batching:
                self._run_async(max_steps)
            else:
                self._run_sync(max_steps)
        finally:
            self.wall_s += time.perf_counter() - w0
        return self.stats()

    def _schedule(self) -> StepWork:
        t0 = time.perf_counter()
        work = self.core.schedule()
        self.schedule_wall_s += time.perf_counter() - t0
        if self.telemetry:
            self.events.append(_plan_event(work, self.now))
        return work

    def _stuck(self, work: StepWork) -> RuntimeError:
        waiting = list(self.core.scheduler.waiting)[:5]
        return RuntimeError(f"simulation made no progress at step {work.step_id}: nothing scheduled and nothing in "
                            f"flight, {len(self.core.requests)} requests unfinished (waiting: {waiting})")

    def _run_sync(self, max_steps: int | None) -> None:
        n = 0
        while self.core.has_work and (max_steps is None or n < max_steps):
            start = self.now
            work = self._schedule()
            if work.empty and not work.swap_outs:
                if work.failed or work.offloads:
                    continue  # progress without a forward (the engine's loop turns over the same way)
                raise self._stuck(work)
            cost = self.cost.step(StepLoad.from_work(work, self.layout))
            self.now = start + cost.total_s
            self._apply(work, cost, start)
            n += 1

    def _run_async(self, max_steps: int | None) -> None:
        # Mirrors cbnb.Engine's async loop: schedule + launch N+1, then collect and apply N. Two resources on the
        # virtual timeline: the host (scheduling, packing, applying) and the device (launched work, in order).
        inflight: tuple[StepWork, StepCost, float, float] | None = None  # (work, cost, start, device end)
        device_free = 0.0
        n = 0
        while self.core.has_work or inflight is not None:
            if not self.core.has_work or (max_steps is not None and n >= max_steps):
                if inflight is not None:
                    inflight = self._collect(inflight)
                    continue
                break
            start = self.now
            work = self._schedule()
            if work.empty and not work.swap_outs:
                if inflight is None:
                    if work.failed or work.offloads:
                        continue
                    raise self._stuck(work)
                inflight = self._collect(inflight)  # what blocks scheduling may be the step in flight
                continue
            cost = self.cost.step(StepLoad.from_work(work, self.layout))
            launched = start + cost.host_s
            device_end = max(launched, device_free) + cost.device_s
            device_free = device_end
            self.now = launched
            if inflight is not None:
                self._collect(inflight)
            inflight = (work, cost, start, device_end)
            n += 1

    def _collect(self, inflight: tuple[StepWork, StepCost, float, float]) -> None:
        work, cost, start, device_end = inflight
        self.now = max(self.now, device_end)
        self._apply(work, cost, start)
        return None

    def _apply(self, work: StepWork, cost: StepCost, start: float) -> None:
        tokens = {s.request_id: SIM_TOKEN for s in work.plan.scheduled if s.samples}
        self.core.apply(work, tokens)
        last = self.steps[-1].end_s if self.steps else 0.0
        t0 = max(start, last)
        self.steps.append(SimStep(work.step_id, t0, self.now, cost))
        timings = {"forward": cost.compute_s, "launch": cost.launch_s, "host": cost.host_s}
        self._stats.on_step(work.plan, work.offloads, len(work.restores), timings, t0, self.now)
        if self.telemetry:
            for d in work.offloads:
                self.events.append(Offload(work.step_id, start, d.request.request_id, d.path, d.reason,
                                           d.blocks_freed, d.tokens_to_recompute))
        if self.telemetry and (self._kv_sample_t is None or self.now - self._kv_sample_t >= 0.2):
            self._kv_sample_t = self.now  # the engine's rule (a KV usage sample every 0.2 s), in simulated seconds
            self._stats.on_kv(kv_usage(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()}))

    # ------------------------------------------------------------------------------------------ read API
    def stats(self) -> dict[str, Any]:
        """{"run": `RunStats.summary()` in virtual seconds, "memory_bytes": the split, "sim": clock and host cost}."""
        return {"run": self._stats.summary(), "memory_bytes": self.memory_split(),
                "sim": {"sim_time_s": self.now, "steps": len(self.steps), "wall_s": self.wall_s,
                        "schedule_wall_s": self.schedule_wall_s, "async_batching": self.async_batching,
                        "num_blocks": self.config.num_blocks, "profile": self.profile.name, "shape": self.shape.name}}

    def reset_stats(self) -> None:
        """Start a new run for `stats()["run"]`."""
        self._stats = RunStats()

    def memory_split(self) -> dict[str, int]:
        """Bytes by use: weights, kv_cache, activations, logits, swap_pool (as `cbnb.Engine.memory_split`)."""
        split = self.memory.split()
        split["swap_pool"] = self.swap_sectors * self.layout.bytes_per_sector
        return split

    def snapshot(self) -> KVSnapshot:
        """The KV page map now (see `cbnb.cache.snapshot`)."""
        return kv_snapshot(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})

    def requests_snapshot(self) -> list[RequestOutput]:
        """Live requests (arrival order) followed by the most recently ended ones (up to 256)."""
        live = sorted(self.core.requests.values(), key=lambda r: r.arrival)
        return [r.output() for r in live] + list(self._recent)

    def __repr__(self) -> str:
        c = self.config
        return (f"SimEngine({self.shape.name} on {self.profile.name}, t={self.now:.3f}s, page_size={c.page_size}, "
                f"num_blocks={c.num_blocks}, max_batch_tokens={c.max_batch_tokens}, scheduler={c.scheduler_type})")


def _plan_event(work: StepWork, t: float) -> Event:
    # TODO(issue 10): the shared recorder's StepPlanned builder (the same fields as cbnb.Engine's `_plan_event`).
    p = work.plan
    return StepPlanned(
        work.step_id, t, p.scheduler,
        [(s.request_id, s.phase, s.num_tokens, s.start, s.prefix_hit_tokens) for s in p.scheduled],
        [(k.reason.value, list(k.request_ids), dict(k.detail)) for k in p.skipped],
        [(st.request_id, list(st.blocks_needed), list(st.blocks_available)) for st in p.stalled],
        p.token_budget, p.num_tokens, p.num_prefill_tokens, p.num_decode_tokens, p.cache_budget,
        p.cache_read_tokens, p.request_cap, len(p.scheduled), p.free_fraction, p.safety_margin,
    )
