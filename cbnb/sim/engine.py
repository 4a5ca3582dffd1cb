"""`SimEngine`: the engine shell on a virtual clock, with the cost model as its executor (torch-free).

`SimEngine` is `cbnb.engine.shell.EngineShell`, the lifecycle `cbnb.Engine` has too (generate, cancel_all, the step
mode, reconfigure's run segments, stats, reset_stats, snapshot, memory_split, explain, serve), with two parts injected:
the executor `cbnb.sim.executor.SimExecutor` (the `CostModel` in the runner's place: placeholder tokens and a step
cost) and a virtual clock (`now`, simulated seconds). It drives the real `cbnb.core.engine_core.EngineCore` (the same
schedulers, cache manager, prefix index, offload policy), sizes the cache with the engine's sizing path
(`cbnb.core.cache.sizing.plan_memory`) from the profile's memory, `max_memory_percent` and the weights' bytes, validates
prompts and arguments with `cbnb.engine.prompts`, records with the engine's `cbnb.telemetry.recorder.Recorder`, and runs
the engine loop's own turns (`cbnb.engine.loop`, with `cbnb.sim.arrivals.Arrivals` as its inbox and a virtual
clock): synchronous, or async batching (a GPU profile with CUDA graphs, or
``async_batching=True``). So the same calls give the same StepPlanned records, the same event kinds in the same
order, the same run segments and the same `stats()` keys as `cbnb.Engine`; only times differ (simulated seconds).

Every sample is the token `SIM_TOKEN` and EOS never ends a request, so a request generates exactly its
`max_new_tokens` (None: up to the model's max positions). `submit` takes every keyword of `Engine.submit`;
sampling and logits-processor arguments are validated as there but change nothing (sampling is costed as greedy);
what needs logits or text (``logprobs``, ``prompt_logprobs``, ``stop``) raises a `ValueError` naming the keyword.

Three ways to run it (`cbnb.sim.driving`):

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
from dataclasses import dataclass
from typing import Any

from ..core.cache.sizing import MemoryPlan
from ..core.config import ContinuousBatchingConfig
from ..core.generation import REQUEST_ARGS
from ..engine.handle import check_timeout
from ..engine.phases import LoopState
from ..engine.prompts import prompt_ids, prompt_preview, sampling_params
from ..core.requests import Request, RequestOutput
from ..telemetry.runs import RunLog
from ..engine.shell import EngineShell
from ..engine import submit_schema
from ..telemetry.recorder import Recorder
from .arrivals import Arrivals, SimulationStuck, VirtualClock
from .build import SimBuilder
from .clock import SimClock
from .driving import SimDriving, SimHandle
from .executor import SIM_TOKEN, SimStep
from .profiles import HardwareProfile, load_profile
from .shapes import ModelShape, load_shape

__all__ = ["SimEngine", "SimStep", "SimHandle", "SimDevice", "SimulationStuck", "SIM_TOKEN"]

#: `submit` keywords a simulation cannot honour: it has no logits and no text.
_NEEDS_A_MODEL = tuple(f.name for f in submit_schema.FIELDS.values() if f.sim == "refused")


@dataclass(frozen=True)
class SimDevice:
    """Where a `SimEngine` pretends to run: `type` as a torch device type ("cuda", "cpu"), and the profile's name."""

    type: str
    profile: str

    def __str__(self) -> str:
        return f"sim:{self.profile}"


class SimEngine(SimDriving, EngineShell):
    """Simulate cbnb serving a model shape on a hardware profile.

    Args:
        shape: a `ModelShape` or anything `load_shape` takes ("llama-3.1-8b", a config.json, a transformers config).
        profile: a `HardwareProfile` or anything `load_profile` takes ("h100-sxm", "cpu", a JSON path).
        config: a `ContinuousBatchingConfig` (default: transformers' defaults), resolved for the profile's device.
        dtype: weights/KV dtype (default: the shape's).
        async_batching: override the resolved `use_async_batching` (None: keep it).
        telemetry: record typed events in `events` (as `cbnb.Engine`).
        event_log_size: events retained.
        runs: the run log to keep (as `cbnb.Engine`'s): a `cbnb.lab.runs.RunLog` (e.g. shared with a real engine, to
            compare predicted and measured runs in one table), or a JSON-lines file path; None: a new log.

    Attributes (as `cbnb.Engine`'s): config, user_config, layout, memory, cache, core, events, device, vocab_size,
    max_positions, weight_bytes, model_id (the shape's Hugging Face id, for exports), tokenizer (None: prompts
    are token ids), runs (the run log: every `cbnb.lab.tuning.run_workload` and every `reconfigure`); and `now` (the
    virtual clock, seconds), `present` (the caller's instant on it), `steps` (`SimStep` per executed step),
    `driver_clock` (a `SimClock`: the tuning lab drives the simulation from the caller's thread).

    Raises:
        ValueError: an unknown shape or profile (named), a bad config value, or a dtype the profile has no FLOP/s
            for (e.g. bfloat16 on a CPU profile from `calibrate()`, which measures float32: pass
            ``dtype="float32"``); the dtype is checked here, never switched to the profile's.
        MemoryError: the weights or the configured cache do not fit the profile's memory.
    """

    tokenizer = None
    default_eos: frozenset[int] = frozenset()
    #: Its tokens are placeholders (`cbnb.sim.executor.SIM_TOKEN`): panels show how many, not their ids.
    placeholder_tokens = True

    def __init__(self, shape: Any, profile: Any, config: ContinuousBatchingConfig | None = None, *,
                 dtype: Any = None, async_batching: bool | None = None, telemetry: bool = True,
                 event_log_size: int = 100_000, runs: Any = None) -> None:
        self.shape: ModelShape = load_shape(shape, dtype=dtype)
        self.profile: HardwareProfile = load_profile(profile)
        self._check_dtype(dtype)
        if config is not None and not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        self.max_positions = self.shape.max_position_embeddings
        self.vocab_size = self.shape.vocab_size
        self.device = SimDevice(self.profile.device_type, self.profile.name)
        self.telemetry = bool(telemetry)
        self._clock = clock = VirtualClock()
        lock = threading.RLock()
        self._arrivals = arrivals = Arrivals(clock, lock)
        self._loop = state = LoopState(SimBuilder(self.shape, self.profile, clock, async_batching),
                                       Recorder(self.telemetry, event_log_size, clock=clock), arrivals, lock)
        arrivals.state = state
        state.ended = {}  # every ended request, for `outputs()`
        self._driving = threading.Lock()  # held by the thread running the turns caller-driven
        self._order: list[str] = []
        self._ids = itertools.count()
        self._last_arrival = 0.0
        self._playback = None
        self.wall_s = 0.0  # host seconds spent in run()/run_until()
        self._present = 0.0  # the caller's instant: run_until(t) leaves it at t while a step started before t runs on
        self.engine_name = f"sim-{self.profile.name}"
        self.model_id = self.shape.hf_id or self.shape.name  # what exports name as the model to serve
        self.driver_clock = SimClock(self)
        state.install(config or ContinuousBatchingConfig())
        state.recorder.flush()
        self.runs = runs if isinstance(runs, RunLog) else RunLog(base=self.user_config, path=runs)

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
        return self._loop.builder.plan_memory(config)

    config = property(lambda self: self._loop.config, doc="The resolved `ContinuousBatchingConfig` in use.")
    user_config = property(lambda self: self._loop.user_config, doc="The config as given (Nones kept).")
    layout = property(lambda self: self._loop.layout, doc="The KV cache geometry (`KVLayout`).")
    memory = property(lambda self: self._loop.memory, doc="The cache's `MemoryPlan` (bytes by use).")
    async_batching = property(lambda self: self._loop.runner.async_mode, doc="Whether steps are double-buffered.")
    swap_sectors = property(lambda self: self._loop.runner.swap_sectors, doc="The host swap pool (sectors).")
    weight_bytes = property(lambda self: self._loop.builder.weight_bytes, doc="The weights' bytes (the shape's).")

    def reconfigure(self, config: ContinuousBatchingConfig | None = None, timeout: float | None = 60.0,
                    **changes: Any) -> ContinuousBatchingConfig:
        """Apply a new config (as `Engine.reconfigure`): unfinished requests restart from their prompt and the tokens
        generated so far in the new cache; requests yet to arrive keep their arrival times. Step numbers go on, and
        a `RunStarted` event ("reconfigure", the changed fields) starts a run segment. Returns the resolved config.
        Keywords change fields of a config: ``reconfigure(page_size=32)`` is
        ``reconfigure(self.user_config.copy(page_size=32))``.

        Raises:
            ValueError / MemoryError: the new config cannot be applied (the old one stays in force).
            TimeoutError: the playback thread did not let go within `timeout` seconds.
        """
        config = self._config_of(config, changes)  # reconfigure(page_size=32): the config in force, changed
        if not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        timeout = check_timeout(timeout)
        state = self._loop
        state.builder.check(config)  # refuse what cannot fit before anything changes
        if not state.lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("reconfigure did not complete")
        try:
            if state.inflight is not None:
                state.finish()
            self._present = max(self._present, self._clock.now)
            old = self.user_config
            state.rebuild(config)  # the engine's rebuild: unfinished requests carried, a RunStarted marker
            state.recorder.flush()
        finally:
            state.lock.release()
        self._reconfigured(old)
        return self.config

    now = property(lambda self: self._clock.now, doc="The virtual clock (simulated seconds).")
    steps = property(lambda self: self._loop.runner.steps, doc="Every executed step (`SimStep`), in order.")

    @property
    def present(self) -> float:
        """The caller's instant (simulated seconds): where `run_until(t)` left it (``t``, while the step that started
        before ``t`` may end after it), else the clock. A submission without `arrival_s` arrives then."""
        return self._playback.paced_now() if self._playback is not None else self._present

    def _swap_bytes(self) -> int:
        return self.swap_sectors * self.layout.bytes_per_sector

    # ------------------------------------------------------------------------------------------ requests
    def encode(self, prompt: Any, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt (token ids only: a SimEngine has no tokenizer; see `cbnb.engine.prompts`)."""
        return prompt_ids(prompt, tokenizer=None, vocab_size=self.vocab_size, chat=chat)

    def submit(self, prompt: Any, *args: Any, **kwargs: Any) -> SimHandle:
        """Queue one request (thread-safe) with the keywords of `Engine.submit`, arriving at `arrival_s`.

        Args:
            prompt: token ids (a list/tuple, a 1-D array or tensor, a tokenizer output of one row).
            max_new_tokens: tokens to generate (exactly: EOS never ends a simulated request); None: up to the
                model's max positions.
            do_sample, temperature, top_k, top_p, min_p, seed, eos_token_id, ignore_eos, chat and the logits
                processors' arguments: validated as `Engine.submit` does (token ids against the shape's vocabulary);
                they do not change the simulation (sampling is costed as greedy, EOS is ignored).
            source: who sent it (as `Engine.submit`).
            logprobs, prompt_logprobs, stop: refused when set (a simulation has no logits and no text).
            response_format, json_schema: accepted and ignored (a constrained request costs as an unconstrained
                one here: the grammar's host time is not modelled); the tokens are placeholders either way.
            request_id: a unique id (default "sim-N").
            arrival_s: when the request reaches the engine (simulated seconds, >= the previous submission's arrival
                and >= `present`); None: at `present`.

        Raises:
            TypeError / ValueError: as `Engine.submit` (the message names the field); `arrival_s` out of order,
                before the clock, or not a finite number; a keyword a simulation cannot honour.
            RuntimeError: the simulation died (see `error`).
        """
        a = submit_schema.bind(prompt, args, kwargs, simulated=True)
        for k in _NEEDS_A_MODEL:
            if a[k] is not None:
                raise ValueError(f"{k}: a SimEngine cannot honour it (it simulates no logits and no text); got {a[k]!r}")
        chat, source, request_id, arrival_s = a["chat"], a["source"], a["request_id"], a["arrival_s"]
        args = {k: a[k] for k in REQUEST_ARGS if a[k] is not None}  # None: the default
        eos_token_id = a["eos_token_id"]
        ids = self.encode(prompt, chat)
        args["ignore_eos"] = True
        sp, cap = sampling_params(len(ids), args, eos_token_id=eos_token_id, vocab_size=self.vocab_size,
                                  max_positions=self.max_positions)
        state = self._loop
        with state.lock:
            if state.state == "dead":
                raise RuntimeError(f"the simulation died: {self.error!r}")
            t = self._arrival(arrival_s)
            rid = request_id if request_id is not None else f"sim-{next(self._ids)}"
            if rid in state.ended:
                raise ValueError(f"request_id {rid!r} is already in use")
            req = Request(rid, ids, sp, max_new_tokens_cap=cap, now=t, source=source)
            req.prompt_text = prompt_preview(prompt)
            handle = SimHandle(req, self)
            self._handles.add(handle, self.config.max_queue_size)
            self._order.append(rid)
            self._arrivals.add(req, t)
            if arrival_s is not None:
                self._last_arrival = t
            if state.paused and state.inflight is None:
                state.admit()  # as the paused engine's loop admits what reaches it: PENDING, explainable
                state.recorder.flush()
            if self._playback is not None:
                self._playback.idle.clear()
        if self._arrivals.driver is not None:
            self._arrivals.wake()  # a thread that runs the turns looks at it now (a hold, a paced idle wait)
        return handle

    submit.__signature__ = submit_schema.signature(simulated=True, returns="SimHandle")
    #: The `submit` keywords a simulation honours (`cbnb.engine.engine_like`): all but those needing logits or text;
    #: response_format / json_schema are accepted but not listed (the server refuses them for a simulation).
    submit_keywords = submit_schema.simulated_keywords()

    def _arrival(self, arrival_s: float | None) -> float:
        now = self.present
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

    def _untaken(self) -> list[Request]:
        with self._loop.lock:
            return self._arrivals.due()

    def outputs(self) -> list[RequestOutput]:
        """Terminal outputs of every request submitted so far that has ended, in submission order."""
        with self._loop.lock:
            ended = self._loop.ended
            return [ended[r].output() for r in self._order if r in ended]

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state, including one yet to arrive (it ends CANCELLED, blocks freed at once).
        A request that has arrived but was not admitted yet is admitted first (with those due before it), as the
        threaded engine admits what reached its inbox. False when unknown or already ended."""
        state, arrivals = self._loop, self._arrivals
        with state.lock:
            t = arrivals.arrival_of(request_id)
            if t is not None and t <= self._clock.now and state.inflight is None:
                state.admit()
            if self.core.cancel(request_id) is not None:
                state.recorder.flush()
            else:
                req = arrivals.remove(request_id)
                if req is None:
                    return False
                state.withdraw(req)
        arrivals.wake()  # a held caller waiting for this request looks again
        return True

    def __repr__(self) -> str:
        c = self.config
        return (f"SimEngine({self.shape.name} on {self.profile.name}, {self.state}, t={self.now:.3f}s, "
                f"page_size={c.page_size}, num_blocks={c.num_blocks}, max_batch_tokens={c.max_batch_tokens}, "
                f"scheduler={c.scheduler_type})")
