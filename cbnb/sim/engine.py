"""`SimEngine`: cbnb's own core on a virtual clock, costed by `CostModel` instead of a model forward (torch-free).

The decisions are cbnb's by construction: `SimEngine` drives the real `cbnb.core.EngineCore` (the same schedulers,
cache manager, prefix index, offload policy), sizes the cache with the engine's sizing path
(`cbnb.cache.sizing.plan_memory`) from the profile's memory, `max_memory_percent` and the weights' bytes, validates
prompts and arguments with `cbnb.prompts`, records events and statistics with the engine's `cbnb.telemetry.Recorder`,
and runs the engine loop's turns (`cbnb.sim.loop`): synchronous, or async batching (a GPU profile with CUDA graphs,
or ``async_batching=True``) where step N+1 is planned and launched before step N is applied. So the same workload
gives the same StepPlanned records, the same event types in the same order and the same `stats()` keys as
`cbnb.Engine`; only times differ (simulated seconds, from the cost model).

Every sample is the token `SIM_TOKEN` and EOS never ends a request, so a request generates exactly its
`max_new_tokens` (None: up to the model's max positions). Sampling arguments are validated as `Engine.submit` does
but change nothing (sampling is costed as greedy).

Three ways to run it:

- caller-driven (default): `run()` (until every submitted request has ended), `run_until(t)` (simulated seconds),
  `generate(...)`, or a handle's `result()`, which runs the simulation until that request ends;
- `start()`: on its own thread, as fast as possible (the clock jumps over idle gaps), like `cbnb.Engine`;
- `start(speed=x)`: on its own thread at x times simulated time, so `cbnb.ui.Dashboard(sim)` animates.

Arrival times: ``submit(..., arrival_s=t)`` queues a request that reaches the engine at simulated second ``t``;
arrival times must not decrease from one submission to the next, and never lie before the caller's present
(`present`: where `run_until(t)` left the caller, ``t``, even while a step that started before ``t`` runs on; a
`ValueError` naming ``arrival_s``). Without `arrival_s` a request arrives at the present (submitted during a step, it
waits for that step, as on the real engine). The tuning lab drives it through `driver_clock` (`cbnb.sim.clock`).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..cache.manager import CacheManager
from ..cache.sizing import MemoryPlan, plan_memory
from ..cache.snapshot import KVSnapshot, kv_snapshot
from ..config import ContinuousBatchingConfig
from ..core import EngineCore
from ..handle import HandleTable, RequestHandle, check_timeout
from ..prompts import prompt_ids, sampling_params, split_batch
from ..requests import Request, RequestOutput, RequestState
from ..runs import RunLog
from ..telemetry import Recorder
from ._gc import relaxed_gc
from .clock import SimClock
from .cost import CostModel
from .loop import SIM_TOKEN, SimStep, SimulationStuck, VirtualLoop
from .playback import Playback, check_speed
from .profiles import HardwareProfile, load_profile
from .shapes import ModelShape, load_shape

__all__ = ["SimEngine", "SimStep", "SimHandle", "SimDevice", "SimulationStuck", "SIM_TOKEN"]

_UNLIMITED_HOST = 1 << 60


@dataclass(frozen=True)
class SimDevice:
    """Where a `SimEngine` pretends to run: `type` as a torch device type ("cuda", "cpu"), and the profile's name."""

    type: str
    profile: str

    def __str__(self) -> str:
        return f"sim:{self.profile}"


class SimHandle(RequestHandle):
    """`cbnb.RequestHandle` of a simulated request. On an engine with no playback thread (caller-driven), waiting
    on it runs the simulation on the caller's thread: `result()` until this request has ended, iteration until its
    next tokens (`async for` until it has ended)."""

    def __init__(self, request: Request, sim: "SimEngine") -> None:
        super().__init__(request, None, sim.cancel)
        self._drive = weakref.WeakMethod(sim._drive_until)

    def _run_until(self, cond: Callable[[], bool]) -> None:
        drive = self._drive()
        if drive is not None and not cond():
            drive(cond)

    def result(self, timeout: float | None = None) -> RequestOutput:
        self._run_until(self.done)
        return super().result(timeout)

    def _before_wait(self) -> None:
        q = self._q
        self._run_until(lambda: not q.empty() or self.done())

    async def __aiter__(self):
        self._run_until(self.done)
        async for d in super().__aiter__():
            yield d


class SimEngine:
    """Simulate cbnb serving a model shape on a hardware profile.

    Args:
        shape: a `ModelShape` or anything `load_shape` takes ("llama-3.1-8b", a config.json, a transformers config).
        profile: a `HardwareProfile` or anything `load_profile` takes ("h100-sxm", "cpu", a JSON path).
        config: a `ContinuousBatchingConfig` (default: transformers' defaults), resolved for the profile's device.
        dtype: weights/KV dtype (default: the shape's).
        async_batching: override the resolved `use_async_batching` (None: keep it).
        telemetry: record typed events in `events` (as `cbnb.Engine`).
        event_log_size: events retained.
        runs: the run log to keep (as `cbnb.Engine`'s): a `cbnb.runs.RunLog` (e.g. shared with a real engine, to
            compare predicted and measured runs in one table), or a JSON-lines file path; None: a new log.

    Attributes (as `cbnb.Engine`'s): config, user_config, layout, memory, cache, core, events, device, vocab_size,
    max_positions, weight_bytes, model_id (the shape's Hugging Face id, for exports), tokenizer (None: prompts
    are token ids), runs (the run log: every
    `cbnb.tuning.run_workload` and every `reconfigure`); and `now` (the virtual clock, seconds), `present` (the
    caller's instant on it), `steps` (`SimStep` per executed step), `driver_clock` (a `SimClock`).

    The tuning lab's engine protocol (`cbnb.driver`, `cbnb.tuning`): ``engine_name`` ("sim-<profile>", how the run
    log names its runs), ``records_reconfigures`` (True), ``driver_clock`` (virtual time, so `run_workload` and
    `sweep` drive the simulation from the caller's thread), ``runs``, ``reset_stats``, ``stats``, ``generate``.

    Raises:
        ValueError: an unknown shape or profile (named), a bad config value, or a dtype the profile has no FLOP/s
            for (e.g. bfloat16 on a CPU profile from `calibrate()`, which measures float32: pass
            ``dtype="float32"``); the dtype is checked here, never switched to the profile's.
        MemoryError: the weights or the configured cache do not fit the profile's memory.
    """

    tokenizer = None
    default_eos: frozenset[int] = frozenset()
    records_reconfigures = True

    def __init__(self, shape: Any, profile: Any, config: ContinuousBatchingConfig | None = None, *,
                 dtype: Any = None, async_batching: bool | None = None, telemetry: bool = True,
                 event_log_size: int = 100_000, runs: Any = None) -> None:
        self.shape: ModelShape = load_shape(shape, dtype=dtype)
        self.profile: HardwareProfile = load_profile(profile)
        self._check_dtype(dtype)
        if config is not None and not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        self.weight_bytes = self.shape.weight_bytes()
        self.max_positions = self.shape.max_position_embeddings
        self.vocab_size = self.shape.vocab_size
        self.device = SimDevice(self.profile.device_type, self.profile.name)
        self.telemetry = bool(telemetry)
        self._async_override = async_batching
        self._lock = threading.RLock()
        self._handles = HandleTable()
        self.recorder = Recorder(self.telemetry, event_log_size, clock=self._clock)
        self._loop = VirtualLoop(self.recorder, self._deliver)
        self._ended: dict[str, Request] = {}  # every ended request, for `outputs()`
        self._order: list[str] = []
        self._recent: deque[Request] = deque(maxlen=256)
        self._ids = itertools.count()
        self._last_arrival = 0.0
        self._playback: Playback | None = None
        self._state = "created"
        self.error: BaseException | None = None
        self.wall_s = 0.0  # host seconds spent in run()/run_until()
        self._present = 0.0  # the caller's instant: run_until(t) leaves it at t while a step started before t runs on
        self.engine_name = f"sim-{self.profile.name}"
        self.model_id = self.shape.hf_id or self.shape.name  # what exports name as the model to serve
        self.driver_clock = SimClock(self)
        self._install(config or ContinuousBatchingConfig())
        self.runs = runs if isinstance(runs, RunLog) else RunLog(base=self.user_config, path=runs)

    def _clock(self) -> float:
        return self._loop.now

    def _check_dtype(self, asked: Any) -> None:
        """The cost model needs the profile's FLOP/s for the shape's dtype: refuse at construction, not at the first
        step (the dtype is never switched silently: memory and speed both depend on it)."""
        try:
            self.profile.peak(self.shape.dtype)
        except ValueError:
            have = ", ".join(self.profile.peak_flops)
            fit = next((k for k in self.profile.peak_flops if k != "tf32"), "float32")
            whose = "the dtype passed" if asked is not None else f"the shape's dtype (of {self.shape.name})"
            raise ValueError(f"dtype must be one profile {self.profile.name!r} has FLOP/s for ({have}); got "
                             f"{self.shape.dtype} ({whose}): pass dtype= one of those, e.g. "
                             f"SimEngine({self.shape.name!r}, profile, dtype={fit!r})"
                             ) from None

    # ------------------------------------------------------------------------------------------ parts
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

    def _install(self, config: ContinuousBatchingConfig, carry: Sequence[Request] = ()) -> None:
        resolved, memory, swap = self.plan_memory(config)
        layout = self.shape.layout(resolved.page_size)
        cache = CacheManager(layout, memory.num_sectors, allow_block_sharing=resolved.allow_block_sharing,
                             prefix_eviction=resolved.prefix_eviction, swap_sectors=swap, sink=self.recorder.sink)
        core = EngineCore(resolved, cache, on_terminal=self._on_terminal, clock=self._clock)
        self.user_config, self.config, self.layout, self.memory, self.swap_sectors = (
            config, resolved, layout, memory, swap)
        ov = self._async_override
        self.async_batching = bool(resolved.use_async_batching if ov is None else ov)
        self._loop.install(core, cache, layout, CostModel(self.shape, self.profile, resolved), self.async_batching)
        for req in carry:
            self.recorder.admit(core, req, resume=True)
        self.recorder.flush()

    def reconfigure(self, config: ContinuousBatchingConfig, timeout: float | None = 60.0) -> ContinuousBatchingConfig:
        """Apply a new config (as `Engine.reconfigure`): unfinished requests restart from their prompt and the tokens
        generated so far in the new cache; requests yet to arrive keep their arrival times. Returns the resolved config.

        Raises:
            ValueError / MemoryError: the new config cannot be applied (the old one stays in force).
            TimeoutError: the playback thread did not let go within `timeout` seconds.
        """
        if not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        timeout = check_timeout(timeout)
        self.plan_memory(config)  # refuse what cannot fit before anything changes
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("reconfigure did not complete")
        try:
            self._loop.finish_inflight()
            self._present = max(self._present, self._loop.now)
            old = self.user_config
            carry = self.core.take_unfinished()
            try:
                self._install(config, carry)
            except BaseException:
                self._install(old, carry)
                raise
        finally:
            self._lock.release()
        self.runs.record_reconfigure(old, self.user_config, engine=self.engine_name)
        return self.config

    cache = property(lambda self: self._loop.cache, doc="The `CacheManager` (block bookkeeping).")
    core = property(lambda self: self._loop.core, doc="The `EngineCore` (requests, scheduler, offload policy).")
    events = property(lambda self: self.recorder.events, doc="The `EventLog` of typed telemetry events.")
    now = property(lambda self: self._loop.now, doc="The virtual clock (simulated seconds).")

    @property
    def present(self) -> float:
        """The caller's instant (simulated seconds): where `run_until(t)` left it (``t``, while the step that started
        before ``t`` may end after it), else the clock. A submission without `arrival_s` arrives then."""
        return self._playback.paced_now() if self._playback is not None else self._present
    steps = property(lambda self: self._loop.steps, doc="Every executed step, in order.")

    # ------------------------------------------------------------------------------------------ requests
    def encode(self, prompt: Any, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt (token ids only: a SimEngine has no tokenizer; see `cbnb.prompts`)."""
        return prompt_ids(prompt, tokenizer=None, vocab_size=self.vocab_size, chat=chat)

    def submit(self, prompt: Any, max_new_tokens: int | None = None, do_sample: bool = False,
               temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
               request_id: str | None = None, *, ignore_eos: bool = True, chat: bool | None = None,
               arrival_s: float | None = None) -> SimHandle:
        """Queue one request (thread-safe), as `Engine.submit`, arriving at `arrival_s` simulated seconds.

        Args:
            prompt: token ids (a list/tuple, a 1-D array or tensor, a tokenizer output of one row).
            max_new_tokens: tokens to generate (exactly: EOS never ends a simulated request); None: up to the
                model's max positions.
            do_sample, temperature, top_k, top_p, seed, eos_token_id, ignore_eos, chat: validated as
                `Engine.submit` does; they do not change the simulation.
            request_id: a unique id (default "sim-N").
            arrival_s: when the request reaches the engine (simulated seconds, >= the previous submission's arrival
                and >= `present`); None: at `present`.

        Raises:
            TypeError / ValueError: as `Engine.submit` (the message names the field); `arrival_s` out of order,
                before the clock, or not a finite number.
            RuntimeError: the playback thread died (see `error`).
        """
        ids = self.encode(prompt, chat)
        args = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, ignore_eos=True)
        sp, cap = sampling_params(len(ids), args, eos_token_id=eos_token_id, max_positions=self.max_positions)
        with self._lock:
            if self._state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            t = self._arrival(arrival_s)
            rid = request_id if request_id is not None else f"sim-{next(self._ids)}"
            if rid in self._ended:
                raise ValueError(f"request_id {rid!r} is already in use")
            req = Request(rid, ids, sp, max_new_tokens_cap=cap, now=t)
            handle = SimHandle(req, self)
            self._handles.add(handle, self.config.max_queue_size)
            self._order.append(rid)
            self._loop.add_arrival(req, t)
            if arrival_s is not None:
                self._last_arrival = t
            pb = self._playback
        if pb is not None:
            pb.idle.clear()
            pb.wake.set()
        return handle

    def _arrival(self, arrival_s: float | None) -> float:
        now = self._playback.paced_now() if self._playback is not None else self._present
        if arrival_s is None:
            return now
        if isinstance(arrival_s, bool) or not isinstance(arrival_s, (int, float)) or not (
                0 <= arrival_s < float("inf")):
            raise ValueError(f"arrival_s must be a finite number of simulated seconds >= 0; got {arrival_s!r}")
        t = float(arrival_s)
        if t < self._last_arrival:
            raise ValueError(f"arrival_s={t!r} is before the previous request's arrival_s={self._last_arrival!r}: "
                             "submit requests in arrival order")
        if t < now:
            raise ValueError(f"arrival_s={t!r} lies in the past: the simulation is already at t={now!r} s")
        return t

    def generate(self, prompts: Iterable[Any], max_new_tokens: int | Sequence[int] | None = None, *,
                 timeout: float | None = None, **sampling: Any) -> list[RequestOutput]:
        """Submit every prompt and wait (caller-driven: run the simulation) until they all ended: one
        `RequestOutput` per prompt, in input order. `max_new_tokens` may also be one value per prompt.

        Raises:
            TypeError / ValueError: as `Engine.generate`; TimeoutError: with a playback thread, when `timeout`
                wall seconds pass first.
        """
        items = split_batch(prompts)
        ns = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(items)
        if len(ns) != len(items):
            raise ValueError(f"max_new_tokens has {len(ns)} entries for {len(items)} prompts")
        handles = [self.submit(p, n, **sampling) for p, n in zip(items, ns)]
        return [h.result(timeout) for h in handles]

    def outputs(self) -> list[RequestOutput]:
        """Terminal outputs of every request submitted so far that has ended, in submission order."""
        with self._lock:
            return [self._ended[r].output() for r in self._order if r in self._ended]

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state, including one yet to arrive (it ends CANCELLED, blocks freed at once).
        False when unknown or already ended."""
        with self._lock:
            if self.core.cancel(request_id) is not None:
                self.recorder.flush()
                return True
            req = self._loop.remove_arrival(request_id)
            if req is None:
                return False
            self._end_unadmitted(req, RequestState.CANCELLED, "cancelled")
            return True

    def cancel_all(self) -> int:
        """Cancel every unfinished request (as `cancel`). Returns how many."""
        with self._lock:
            return sum(1 for rid in self._handles.live_ids() if self.cancel(rid))

    def _end_unadmitted(self, req: Request, state: RequestState, reason: str, error: str | None = None) -> None:
        req.error = error
        req.finish_reason = reason
        req.transition(state, self._loop.now)
        self._on_terminal(req)
        self.recorder.flush()

    def _deliver(self, req: Request, token_ids: list[int]) -> None:
        self._handles.deliver(req.request_id, token_ids, req.state)

    def _on_terminal(self, req: Request) -> None:
        self.recorder.request_done(req)
        self._ended[req.request_id] = req
        self._recent.append(req)
        self._handles.finish(req)

    # ------------------------------------------------------------------------------------------ caller-driven
    def _check_caller_driven(self) -> None:
        if self._playback is not None:
            raise RuntimeError("the simulation runs on its playback thread: call stop() before run()/run_until()")
        if self._state == "dead":
            raise RuntimeError(f"the simulation died: {self.error!r}")

    def _drive(self, until: Callable[[], bool], horizon: float | None = None, max_steps: int | None = None) -> None:
        """Run turns (caller's thread) until `until()`, the clock reaches `horizon`, or `max_steps` steps ran."""
        self._check_caller_driven()
        w0 = time.perf_counter()
        try:
            with relaxed_gc():
                self._turns(until, horizon, max_steps)
        except SimulationStuck as e:
            self._die(e)
            raise
        finally:
            self.wall_s += time.perf_counter() - w0
            self._present = max(self._present, self._loop.now if horizon is None else horizon)

    def _turns(self, until: Callable[[], bool], horizon: float | None, max_steps: int | None) -> None:
        loop = self._loop
        first = loop.steps_run
        while not until():
            if max_steps is not None and loop.steps_run - first >= max_steps:
                return
            if horizon is not None and loop.now >= horizon:
                return
            with self._lock:
                if loop.turn():
                    continue
                nxt = loop.next_arrival_s  # idle: nothing can run before the next arrival
                if nxt is None:
                    if horizon is not None:
                        loop.idle_until(horizon)
                    return
                loop.idle_until(nxt if horizon is None else min(nxt, horizon))

    def _drive_until(self, done: Callable[[], bool]) -> None:
        if self._playback is None and self._state != "dead":
            self._drive(done)

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        """Run until every submitted request has ended, arrivals included (or `max_steps` more steps ran).
        Returns `stats()`.

        Raises:
            SimulationStuck: a step scheduled nothing while requests wait and nothing is in flight.
            RuntimeError: while the playback thread runs.
        """
        loop = self._loop
        self._drive(lambda: not loop.busy, max_steps=max_steps)
        with self._lock:
            loop.finish_inflight()
            self._present = max(self._present, loop.now)
        return self.stats()

    def run_until(self, t: float) -> dict[str, Any]:
        """Run until the virtual clock reaches `t` simulated seconds: every step that starts before `t` runs (the
        last may end after it); idle time passes up to `t`. A step in flight (async batching) stays in flight, so
        running in pieces makes the same decisions as one `run()`. Returns `stats()`.

        Raises:
            ValueError: `t` is not a finite number.
        """
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not abs(t) < float("inf"):
            raise ValueError(f"t must be a finite number of simulated seconds; got {t!r}")
        self._drive(lambda: False, horizon=float(t))
        return self.stats()

    # ------------------------------------------------------------------------------------------ playback thread
    @property
    def state(self) -> str:
        """"created" (never started), "running" (playback thread), "stopped" (requests kept: `run()` or `start()`
        go on), or "dead" (see `error`)."""
        return self._state

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def speed(self) -> float | None:
        """Simulated seconds per wall second of the playback thread (None: as fast as possible). Settable."""
        return self._playback.speed if self._playback is not None else None

    @speed.setter
    def speed(self, speed: float | None) -> None:
        speed = check_speed(speed)
        if self._playback is not None:
            self._playback.set_speed(speed)

    def start(self, speed: float | None = None) -> "SimEngine":
        """Run on a playback thread: as fast as possible (None), or at `speed` x simulated time. No-op (except
        for the speed) when running.

        Raises:
            ValueError: a `speed` that is not None or a number > 0. RuntimeError: the simulation died.
        """
        speed = check_speed(speed)
        with self._lock:
            if self._state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            if self._playback is not None:
                self._playback.set_speed(speed)
                return self
            self._playback = Playback(self, speed)
            self._state = "running"
            self._playback.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the playback thread after its current turn. Unfinished requests are kept (`run()` or `start()`
        continue the simulation)."""
        pb = self._playback
        if pb is None:
            return
        pb.stop(timeout)
        with self._lock:
            self._playback = None
            self._present = max(self._present, self._loop.now)
            if self._state == "running":
                self._state = "stopped"

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the playback thread has nothing left to do (every submitted request ended). False on timeout.
        Without a playback thread: run the simulation (`run()`) and return True."""
        pb = self._playback
        if pb is None:
            self.run()
            return True
        return pb.idle.wait(check_timeout(timeout))

    def _die(self, error: BaseException) -> None:
        """The simulation cannot go on: every unfinished request ends FAILED with the reason."""
        with self._lock:
            self.error = error
            self._state = "dead"
            reason = f"simulation died: {type(error).__name__}: {error}"
            if self.core is not None:
                self.core.fail_all(reason)
            for req in self._loop.take_arrivals():
                self._end_unadmitted(req, RequestState.FAILED, "error", reason)
            self.recorder.flush()

    def __enter__(self) -> "SimEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ read API
    def stats(self) -> dict[str, Any]:
        """As `Engine.stats()`: {"run": `RunStats.summary()` since `reset_stats()`, "cumulative": ...,
        "memory_bytes": `memory_split()`}, in simulated seconds."""
        with self._lock:
            out = self.recorder.summary()
            out["memory_bytes"] = self.memory_split()
        return out

    def sim_stats(self) -> dict[str, Any]:
        """The simulation itself: simulated seconds, steps, host seconds spent (and of those in the scheduler)."""
        loop = self._loop
        return {"sim_time_s": loop.now, "steps": len(loop.steps), "wall_s": self.wall_s,
                "schedule_wall_s": loop.schedule_wall_s, "async_batching": self.async_batching,
                "num_blocks": self.config.num_blocks, "profile": self.profile.name, "shape": self.shape.name,
                "arrivals_pending": loop.num_arrivals}

    def reset_stats(self, label: str = "", *, cause: str = "reset_stats", marker: bool = True) -> None:
        """Start a new run for `stats()["run"]` (the cumulative figures keep counting), as `Engine.reset_stats`.

        Args:
            label: what the new run is (shown by the live plots at the run's marker).
            cause: the marker's cause ("reset_stats", "workload", "reconfigure").
            marker: record a `RunStarted` event (the plots start a new segment there).
        """
        with self._lock:
            self.recorder.reset_run()
        if marker:
            self.recorder.mark_run(cause, label)

    def memory_split(self) -> dict[str, int]:
        """Bytes by use: weights, kv_cache, activations, logits, cuda_graphs, swap_pool (as `Engine.memory_split`)."""
        split = self.memory.split()
        split["swap_pool"] = self.swap_sectors * self.layout.bytes_per_sector
        return split

    def snapshot(self) -> KVSnapshot:
        """The KV page map now (see `cbnb.cache.snapshot`)."""
        with self._lock:
            return kv_snapshot(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})

    def explain(self, request_id: Any) -> Any:
        """A request's story from the event log, as `Engine.explain` (`cbnb.explain.explain_request`).

        Raises:
            KeyError: no event of `request_id` is in the log.
            TypeError: `request_id` is neither an id nor a handle/output (a handle is taken as its id).
        """
        from ..explain import explain_engine_request

        return explain_engine_request(self, request_id)

    def requests_snapshot(self) -> list[RequestOutput]:
        """Live requests (arrival order) followed by the most recently ended ones (up to 256), as `Engine`'s."""
        with self._lock:
            live = sorted(self.core.requests.values(), key=lambda r: r.arrival)
            return [r.output() for r in live] + [r.output() for r in self._recent]

    def __repr__(self) -> str:
        c = self.config
        return (f"SimEngine({self.shape.name} on {self.profile.name}, {self._state}, t={self.now:.3f}s, "
                f"page_size={c.page_size}, num_blocks={c.num_blocks}, max_batch_tokens={c.max_batch_tokens}, "
                f"scheduler={c.scheduler_type})")
