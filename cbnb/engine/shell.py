"""`EngineShell`: the lifecycle both engines share, around an injected executor and clock (torch-free).

::

                    ┌──────────── EngineShell (this module + cbnb.engine.step_mode) ─────────────┐
    submit/cancel ─▶│ handles, step mode, reconfigure bookkeeping, stats, snapshot, explain, ... │
                    └───────────────┬───────────────────────────────────────────┬───────────────┘
                         cbnb.Engine│                                           │cbnb.sim.SimEngine
                 one loop: cbnb.engine.loop turns over cbnb.engine.phases.LoopState, with injected:
          driver: its own thread (loop.run)                    driver: the caller, or the playback thread
          inbox: cbnb.engine.inbox.Inbox (idle: wait)          inbox: cbnb.sim.arrivals.Arrivals (idle: jump the clock)
          executor: the model runner (cbnb.runner)             executor: cbnb.sim.executor.SimExecutor (cost model)
          clock: wall (time.perf_counter)                      clock: virtual (simulated seconds)

Both drive the same `cbnb.core.engine_core.EngineCore` through the same loop turns and record through the same
`cbnb.telemetry.recorder.Recorder`, so the same calls give the same event kinds in the same order, and everything here
(and every fix to it) reaches both engines at once. What a subclass provides:

- ``_loop``: its `LoopState`, with ``lock`` (an RLock every phase that changes state holds), ``recorder``,
  ``core``, ``cache``, ``handles`` (a `cbnb.engine.handle.HandleTable`), ``recent`` (the last ended requests),
  ``paused`` and ``step_rate`` (the step mode);
- ``memory`` (the cache's `MemoryPlan`), ``runs`` (the run log), ``tokenizer`` (None: no text), ``engine_name``;
- ``cancel``, ``submit``, ``reconfigure``, ``start``, ``stop`` and the step mode's three hooks
  (`cbnb.engine.step_mode`); ``_swap_bytes()``, ``_untaken()``.

The protocol the rest of cbnb relies on is written down in `cbnb.engine.engine_like.EngineLike`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

from ..core.cache.snapshot import KVSnapshot, kv_snapshot
from .handle import RequestHandle, check_timeout
from .prompts import split_batch
from ..core.requests import RequestOutput
from .step_mode import StepMode

if TYPE_CHECKING:
    from ..telemetry.explain import RequestStory

__all__ = ["EngineShell"]


class EngineShell(StepMode):
    """The shared half of `cbnb.Engine` and `cbnb.sim.SimEngine` (see the module docstring)."""

    #: `reconfigure` writes its own run-log entry (`cbnb.lab.tuning.reconfigure` then records nothing more).
    records_reconfigures = True
    #: `reset_stats(label, cause=...)` records a `RunStarted` marker (`cbnb.engine.engine_like.marks_runs`).
    marks_runs = True
    engine_name = "cbnb"
    _loop: Any

    # ------------------------------------------------------------------------------------------ parts
    core = property(lambda self: self._loop.core, doc="The `EngineCore` (requests, scheduler, offload policy).")
    cache = property(lambda self: self._loop.cache, doc="The `CacheManager` (block bookkeeping).")
    recorder = property(lambda self: self._loop.recorder, doc="The `Recorder` (events and run statistics).")
    events = property(lambda self: self._loop.recorder.events, doc="The `EventLog` of typed telemetry events.")
    _handles = property(lambda self: self._loop.handles)

    def _swap_bytes(self) -> int:  # pragma: no cover - both engines override it
        return 0

    # ------------------------------------------------------------------------------------------ requests
    def generate(self, prompts: Iterable[Any], max_new_tokens: Any = None, *, timeout: float | None = None,
                 **kwargs: Any) -> list[RequestOutput]:
        """Submit every prompt and wait: one `RequestOutput` per prompt, in input order.

        Args:
            prompts: a list of prompts (each what `submit` takes), a 2-D tensor/array (one prompt per row), or a
                batched tokenizer output (one prompt per row, padding dropped by its attention mask).
            max_new_tokens: one limit for all, or a list/tuple with one per prompt.
            timeout: seconds to wait for all of them (None: no limit); wall seconds on both engines.
            kwargs: the other keywords of `submit` (sampling, logits processors, eos_token_id, ignore_eos, chat,
                stop, logprobs, source), the same for every prompt.

        Raises:
            TypeError: `prompts` is a single prompt (a string, one list of ids: wrap it in a list, or use `submit`).
            ValueError: a bad prompt or sampling value (as `submit`), or a `max_new_tokens` list of another length.
            TimeoutError: when `timeout` seconds pass before all are done.
            KeyboardInterrupt: an interrupt while waiting.
            In every one of these cases, the requests this call submitted are cancelled first.
        """
        timeout = check_timeout(timeout)
        items = split_batch(prompts)
        ns = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(items)
        if len(ns) != len(items):
            raise ValueError(f"max_new_tokens has {len(ns)} entries for {len(items)} prompts")
        handles: list[RequestHandle] = []
        try:
            for p, n in zip(items, ns):
                handles.append(self.submit(p, max_new_tokens=n, **kwargs))
            deadline = None if timeout is None else time.monotonic() + timeout
            outs = []
            for h in handles:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outs.append(h.result(left))
            return outs
        except BaseException as e:
            done = sum(h.done() for h in handles)
            for h in handles:
                h.cancel()
            if isinstance(e, TimeoutError):
                hint = " The engine is paused: engine.resume() or engine.step() lets it go on." if self.paused else ""
                raise TimeoutError(f"generate: {len(handles) - done} of {len(handles)} requests not finished after "
                                   f"{timeout:g} s; they are cancelled.{hint}") from None
            raise

    def _config_of(self, config: Any, changes: dict[str, Any]) -> Any:
        """`reconfigure`'s config: `config` (default: the user config in force) with `changes` applied.

        Raises:
            ValueError: a change that is not a `ContinuousBatchingConfig` field, or a value out of range.
        """
        from ..core.config import ContinuousBatchingConfig

        base = self.user_config if config is None else config
        if not changes:
            return base
        unknown = sorted(set(changes) - set(ContinuousBatchingConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"reconfigure: {unknown[0]!r} is not a ContinuousBatchingConfig field")
        if not isinstance(base, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(base).__name__}")
        return base.copy(**changes)

    def _untaken(self) -> list[Any]:
        """Submitted requests the loop has not taken yet (shown PENDING by `requests_snapshot`)."""
        return []

    def requests_snapshot(self) -> list[RequestOutput]:
        """Live requests (arrival order; submitted ones the loop has not taken yet are PENDING), followed by the most
        recently ended ones (up to 256, with their text)."""
        queued = self._untaken()  # read first: one taken meanwhile is then in `live` (deduplicated)
        with self._loop.lock:
            live = sorted(self.core.requests.values(), key=lambda r: r.arrival)
            ended = list(self._loop.recent)
        seen = {r.request_id for r in live} | {r.request_id for r in ended}
        live += [r for r in queued if r.request_id not in seen]
        for r in ended:  # decoded once, here on the caller's side (the engine thread decodes only stop strings)
            if r.output_ids:
                r.decode_text(self.tokenizer)
        return [r.output() for r in live] + [r.output() for r in ended]

    def cancel_all(self) -> int:
        """Cancel every unfinished request (as `cancel`). Returns how many were cancelled."""
        with self._loop.lock:
            return sum(1 for rid in self._handles.live_ids() if self.cancel(rid))

    def _reconfigured(self, old_user_config: Any) -> None:
        """A reconfigure succeeded (its `RunStarted` marker is recorded by the loop): the run log's entry."""
        self.runs.record_reconfigure(old_user_config, self.user_config, engine=self.engine_name)

    # ------------------------------------------------------------------------------------------ stories
    def explain(self, request_id: "str | RequestHandle") -> "RequestStory":
        """Why a request waited, and everything else that happened to it, from the event log (`cbnb.telemetry.explain`):
        arrival, each step it was left out with the reason and the numbers that decided it (and the config field
        that would change that), its prompt chunks, prefix hits, offloads and restores, and its end.

        Returns:
            a `RequestStory`: ``.entries`` (data), ``.to_dict()``, ``.text()`` (also its ``str``).

        Raises:
            KeyError: no event of `request_id` is in the log (unknown id, telemetry off, or dropped from the log).
            TypeError: `request_id` is neither an id nor a handle/output (a `RequestHandle` is taken as its id).
        """
        from ..telemetry.explain import explain_engine_request

        return explain_engine_request(self, request_id)

    # ------------------------------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        """Figures for this run (since `reset_stats()`) and cumulative, plus the memory split (bytes).

        Returns:
            {"run": RunStats.summary(), "cumulative": ..., "memory_bytes": memory_split(), "clock_s": the engine's
            clock at the read (perf_counter seconds; simulated seconds on a `SimEngine`)}. Names carry units.
        """
        with self._loop.lock:
            out = self._loop.recorder.summary()
            out["memory_bytes"] = self.memory_split()
        return out

    def latency_samples(self, cumulative: bool = True) -> dict[str, list[float]]:
        """Every finished request's latencies in seconds (`RunStats.latency_samples`): {"ttft_s", "tpot_s",
        "e2e_latency_s", "queue_time_s"}, each a list in finishing order, copied under the loop's lock.

        Args:
            cumulative: since the engine was built (never reset: what a Prometheus histogram needs); False: this
                run, since `reset_stats()`.
        """
        with self._loop.lock:
            rec = self._loop.recorder
            return (rec.total if cumulative else rec.run).latency_samples()

    def reset_stats(self, label: str = "", *, cause: str = "reset_stats", marker: bool = True) -> None:
        """Start a new run for `stats()["run"]` (the cumulative figures keep counting).

        Args:
            label: what the new run is (shown by the live plots at the run's marker).
            cause: the marker's cause ("reset_stats", "workload", "reconfigure").
            marker: record a `RunStarted` event (the plots start a new segment there).
        """
        with self._loop.lock:
            self._loop.recorder.reset_run()
        if marker:
            self._loop.recorder.mark_run(cause, label)

    def snapshot(self) -> KVSnapshot:
        """The KV page map now: every block's state, refcount, owner and fill, with the reserved padding blocks
        labelled (see `cbnb.core.cache.snapshot`)."""
        with self._loop.lock:
            return kv_snapshot(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})

    def memory_split(self) -> dict[str, int]:
        """Bytes by use: weights, packed_weights (the CPU runner's packed copies), kv_cache, activations, logits,
        cuda_graphs, swap_pool."""
        split = self.memory.split()
        split["swap_pool"] = self._swap_bytes()
        return split

    # ------------------------------------------------------------------------------------------ serving
    def serve(self, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              **limits: Any) -> Any:
        """Serve this engine over an OpenAI-compatible HTTP API from a background thread of its own; returns the
        running `cbnb.server.Server` (`url`, `counters()`, `stop()`) once the port accepts connections. Starts the
        engine if it was never started.

        Args:
            host: the address to bind; anything but loopback needs `api_key` or `allow_unauthenticated=True`.
            port: the TCP port (0 picks a free one: see `server.port`). A server this process already runs on the
                port is stopped first, so re-running the cell replaces it.
            api_key: the Bearer token clients must send (compared in constant time); None: no key.
            limits: the other `cbnb.server.ServerSettings` fields: allow_unauthenticated, model_name,
                max_body_bytes, max_prompt_tokens, max_tokens_limit, max_concurrent_requests, graceful_shutdown_s.

        Lifetime: the running server holds this engine, so a served engine lives until `server.stop()` or
        `engine.stop()` (which stops its servers), even once no name refers to it; a stopped server lets it go.
        At interpreter exit, servers and engines all stop.

        Raises:
            ImportError: without the web stack: ``pip install 'cbnb[serve]'``.
            ValueError: bad settings (the message names the field), or a non-loopback `host` without `api_key` /
                `allow_unauthenticated`.
            OSError: when another program holds the port.
            RuntimeError: when the engine is stopped or dead.
        """
        from ..server import serve  # imports without the web stack; serve() names the extra when it is missing

        return serve(self, host=host, port=port, api_key=api_key, **limits)
