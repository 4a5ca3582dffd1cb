"""`Engine`: continuous batching on a background thread, with a thread-safe submit / stream / cancel API.

::

    import cbnb
    engine = cbnb.Engine.from_pretrained("smollm2-135m")
    with engine:
        outs = engine.generate(["Hello", [1, 2, 3]], max_new_tokens=16)   # list[RequestOutput], input order
        handle = engine.submit("Tell me a story", max_new_tokens=64, do_sample=True, temperature=0.7)
        for delta in handle:                                             # streamed TokenDelta; `async for` too
            print(delta.text, end="")

The loop (one thread, the only writer of engine state): drain submissions, cancellations and control messages →
`EngineCore.schedule()` (admission, chunking, prefix hits, offload) → `ModelRunner.execute()` (copies, forward,
sampling) → `EngineCore.apply()` (tokens, finishing) → push token ids to each request's handle. Handles queue
without bound, so the loop never waits on a consumer; detokenisation happens on the consumer's side.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import numbers
import queue
import threading
import time
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch

from .cache.layout import layout_for, model_kv_spec
from .cache.manager import CacheManager
from .cache.sizing import MemoryPlan, plan_cache, swap_sectors
from .config import ContinuousBatchingConfig
from .cache.snapshot import KVSnapshot, kv_snapshot, kv_usage
from .core import EngineCore, StepWork
from .events import (BlocksAllocated, BlocksDeduplicated, BlocksDemoted, BlocksFreed, BlocksShared, Event, EventLog,
                     Offload, PrefixHit, RequestAdded, RequestDone, Restore, StateChange, StepPlanned, StepTiming)
from .requests import Request, RequestOutput, RequestState, SamplingParams, TokenDelta
from .stats import RunStats
from .runner.kv import KVStore
from .runner.model_runner import ModelRunner

__all__ = ["Engine", "RequestHandle", "EngineStoppedError"]

MAX_CONSECUTIVE_FAILURES = 3
_FINAL = object()


class EngineStoppedError(RuntimeError):
    """Raised when work is submitted to an engine that was stopped (or died)."""


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


class _Detok:
    """Incremental detokenisation: text of all tokens so far, holding back an incomplete UTF-8 tail."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


class RequestHandle:
    """A submitted request: iterate it for `TokenDelta`s, or wait for its `RequestOutput`.

    Iteration (sync or async) consumes the stream once: once the final delta has been yielded, iterating again
    yields nothing. `result()` can be called any number of times.
    """

    def __init__(self, engine: "Engine", request: Request) -> None:
        self._engine = weakref.ref(engine)
        self.request_id = request.request_id
        self.prompt_token_ids = list(request.prompt_ids)
        self._tokenizer = engine.tokenizer
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._final: RequestOutput | None = None
        self._consumed = False  # the final delta was yielded: a later iteration must not wait for more
        self._notify: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._nlock = threading.Lock()
        self._stream = _Detok(self._tokenizer)

    # ---------------------------------------------------------------- engine side (engine thread only)
    def _wake(self) -> None:
        with self._nlock:
            waiters = list(self._notify)
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass  # the consumer's loop is closed

    def _push(self, token_ids: list[int], state: RequestState) -> None:
        self._q.put((token_ids, state))
        self._wake()

    def _finish(self, output: RequestOutput) -> None:
        if self._tokenizer is not None:
            output.text = self._tokenizer.decode(output.token_ids, skip_special_tokens=True)
        self._final = output
        self._done.set()
        self._q.put(_FINAL)
        self._wake()

    # ---------------------------------------------------------------- consumer side
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request is terminal and return its output.

        Raises:
            TimeoutError: when `timeout` seconds pass first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout} s")
        assert self._final is not None
        return self._final

    def cancel(self) -> bool:
        """Ask the engine to cancel this request (a CANCELLED output follows). False if already done."""
        eng = self._engine()
        if eng is None or self.done():
            return False
        return eng.cancel(self.request_id)

    def _delta(self, item: Any) -> TokenDelta | None:
        if item is _FINAL:
            out = self._final
            assert out is not None
            rest = out.token_ids[len(self._stream.ids):]
            text = self._stream.push(rest, final=True)
            self._consumed = True
            return TokenDelta(self.request_id, rest, text, out.state, True, out.error)
        ids, state = item
        return TokenDelta(self.request_id, ids, self._stream.push(ids), state, False, None)

    def __iter__(self) -> Iterator[TokenDelta]:
        while not self._consumed:
            item = self._q.get()
            d = self._delta(item)
            yield d
            if d.finished:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._nlock:
            self._notify.append((loop, ev))
        try:
            while not self._consumed:
                while True:
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                    d = self._delta(item)
                    yield d
                    if d.finished:
                        return
                await ev.wait()
                ev.clear()
        finally:
            with self._nlock:
                self._notify.remove((loop, ev))

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, done={self.done()})"


class Engine:
    """A continuous-batching engine for one transformers causal LM.

    Args:
        model: a transformers causal LM (`cbnb.load_model` gives one), in eval mode.
        tokenizer: its tokenizer (optional: without one, prompts must be token ids and outputs have no text).
        config: a `ContinuousBatchingConfig` (default: transformers' defaults). It is resolved into
            `engine.config`; the caller's object is never modified.
        device: where the KV cache lives (default: the model's device).
        telemetry: record typed events in `engine.events` (an `EventLog`) and KV usage samples; off, only the
            counters and latencies of `engine.stats()` are kept.
        event_log_size: events retained by `engine.events` (oldest dropped first).

    Attributes:
        config: the resolved config in use (every None filled in for this device: num_blocks, max_batch_tokens,
            CUDA-graph and async flags...).
        user_config: the config as given (or as last passed to `reconfigure`), Nones kept; its `to_code()` is what
            to paste into transformers on another machine, where the Nones resolve for that device.

    Raises:
        ValueError: for an unsupported model (attention types other than full/sliding).
        MemoryError: when the cache cannot be sized in the available memory.
    """

    _ids = itertools.count()

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None,
                 config: ContinuousBatchingConfig | None = None, *, device: torch.device | str | None = None,
                 telemetry: bool = True, event_log_size: int = 100_000) -> None:
        self.model = model
        self.telemetry = bool(telemetry)
        self.events = EventLog(event_log_size)
        self._run_stats = RunStats()
        self._total_stats = RunStats()
        self._mutex = threading.RLock()
        self._ev: list[Event] = []
        self._emitted: dict[str, int] = {}
        self._kv_sample_t = 0.0
        self._recent: "collections.deque[RequestOutput]" = collections.deque(maxlen=256)
        self.tokenizer = tokenizer
        p = next(model.parameters())
        self.device = torch.device(device) if device is not None else p.device
        self.dtype = p.dtype
        self._spec = model_kv_spec(model.config)
        text_cfg = getattr(model.config, "text_config", None) or model.config
        self._spec["intermediate_size"] = getattr(text_cfg, "intermediate_size", None)
        self.max_positions: int | None = self._spec["max_position_embeddings"]
        emb = model.get_input_embeddings()
        self.vocab_size = int(getattr(emb, "num_embeddings", self._spec["vocab_size"]))
        self.default_eos = self._default_eos()
        self.weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        self.weight_bytes += sum(t.numel() * t.element_size() for t in model.buffers())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._handles_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._state = "created"
        self.error: BaseException | None = None
        self._loop_error: str | None = None
        self._build(config or ContinuousBatchingConfig(), carry=[])

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m", config: ContinuousBatchingConfig | None = None, *,
                        dtype: Any = None, device: Any = None, **load_kwargs: Any) -> "Engine":
        """Load a model with `cbnb.load_model(name, ...)` and wrap it in an engine."""
        from .models import load_model

        model, tokenizer = load_model(name, dtype=dtype, device=device, **load_kwargs)
        return cls(model, tokenizer=tokenizer, config=config)

    def _default_eos(self) -> frozenset[int]:
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        return SamplingParams.normalize_eos(eos)

    def plan_memory(self, config: ContinuousBatchingConfig) -> tuple[ContinuousBatchingConfig, MemoryPlan, int]:
        """Resolve `config` for this model and device and size its cache, allocating nothing.

        Returns:
            (resolved config with num_blocks filled in, the memory plan, host swap sectors).
        """
        r = config.resolve(self.device.type)
        layout = layout_for(self._spec, torch.tensor([], dtype=self.dtype).element_size(), r.page_size)
        free = _free_memory(self.device)
        graphs = r.cuda_graph_booleans if self.device.type == "cuda" else (False, False)  # the CUDA runner's
        mp = plan_cache(layout, self._spec, max_batch_tokens=r.max_batch_tokens,
                        max_requests_per_batch=r.max_requests_per_batch, max_memory_percent=r.max_memory_percent,
                        free_bytes=free, weight_bytes=self.weight_bytes, num_blocks=r.num_blocks,
                        cuda_graphs=graphs, io_pairs=2 if r.use_async_batching and any(graphs) else 1)
        swap = 0
        if r.cpu_offload_space is None or r.cpu_offload_space > 0:
            import psutil

            swap = swap_sectors(layout, r.cpu_offload_space, r.cpu_offload_space_safety_threshold,
                                int(psutil.virtual_memory().available))
        r.num_blocks = mp.num_blocks
        return r, mp, swap

    def _build(self, config: ContinuousBatchingConfig, carry: list[Request]) -> None:
        resolved, mp, swap = self.plan_memory(config)
        layout = layout_for(self._spec, torch.tensor([], dtype=self.dtype).element_size(), resolved.page_size)
        cache = CacheManager(layout, mp.num_sectors, allow_block_sharing=resolved.allow_block_sharing,
                             prefix_eviction=resolved.prefix_eviction, swap_sectors=swap,
                             sink=self._cache_event if self.telemetry else None)
        self.store = KVStore(layout, mp.num_sectors, self.device, self.dtype, swap_sectors=swap)
        self.cache = cache
        self.memory = mp
        self.layout = layout
        self.config = resolved
        self.user_config = config
        previous = getattr(self, "runner", None)
        self.core = EngineCore(resolved, cache, on_terminal=self._on_terminal)
        self.runner = ModelRunner(self.model, cache, self.store, seed=resolved.seed)
        if previous is not None:
            self.runner.inherit(previous)  # seeded requests keep their RNG streams
        for req in sorted(carry, key=lambda r: r.arrival):
            self.core.add(req, resume=True)

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def state(self) -> str:
        """"created", "running", "stopped" or "dead" (see `error`)."""
        return self._state

    def start(self) -> "Engine":
        """Start the background loop (no-op when running).

        Raises:
            EngineStoppedError: when the engine died of repeated forward failures (see `engine.error`).
        """
        if self._state == "running":
            return self
        if self._state == "dead":
            raise EngineStoppedError(f"engine died: {self._loop_error}")
        self.runner.activate()
        self._stop_mode: str | None = None
        self._state = "running"
        self._thread = threading.Thread(target=self._loop, name="cbnb-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop and join its thread.

        Args:
            drain: finish every submitted request first; otherwise unfinished requests end CANCELLED
                (error "engine stopped"), so nothing is silently lost.
            timeout: seconds to wait for the thread (None: no limit).
        """
        if self._state != "running":
            return
        self._post(("stop", "drain" if drain else "cancel"))
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(drain=exc_type is None)

    def __del__(self) -> None:
        try:
            if self._state == "running":
                self._post(("stop", "cancel"))
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------ submitting
    def _ensure_running(self) -> None:
        if self._state == "created":
            self.start()
        elif self._state == "stopped":
            raise EngineStoppedError("engine is stopped: call engine.start() (or use `with engine:`) to submit again")
        elif self._state == "dead":
            raise EngineStoppedError(f"engine died: {self._loop_error}")

    def encode(self, prompt: Any, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string (tokenised; chat template applied when `chat` is True, or when None and
        the tokenizer has one), a list of chat messages (dicts with role/content), or token ids.

        Raises:
            ValueError: empty prompt, ids outside [0, vocab_size), or text without a tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the engine has no tokenizer: pass token ids")
            if not prompt:
                raise ValueError("prompt must not be empty")
            use_chat = chat if chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
            if use_chat:
                return self.encode([{"role": "user", "content": prompt}])
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer")
            out = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.flatten().tolist()
            if not isinstance(prompt, Iterable):
                raise ValueError(f"prompt must be a string, chat messages or token ids; got {type(prompt).__name__}")
            ids = []
            for i in prompt:
                if isinstance(i, bool) or not isinstance(i, (int, numbers.Integral)):
                    raise ValueError(f"token ids must be integers; got {i!r}")
                ids.append(int(i))
        if not ids:
            raise ValueError("prompt must contain at least one token; got an empty prompt")
        bad = [i for i in ids if i < 0 or i >= self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def submit(self, prompt: Any, max_new_tokens: int | None = None, do_sample: bool = False,
               temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
               request_id: str | None = None, *, ignore_eos: bool = False, chat: bool | None = None) -> RequestHandle:
        """Queue one request; thread-safe, callable from any thread. Starts the engine if it was never started.

        Args:
            prompt: text, chat messages or token ids (see `encode`).
            max_new_tokens: tokens to generate at most; None: up to the model's max positions.
            do_sample, temperature, top_k, top_p, seed: sampling (greedy by default).
            eos_token_id: stop id(s); None: the model's EOS.
            request_id: a unique id (default: "req-N").
            ignore_eos: never stop on EOS (benchmarks).
            chat: apply the chat template to a text prompt (None: when the tokenizer has one).

        Raises:
            ValueError: bad prompt or sampling values (the message names the field), a duplicate request_id, or a
                prompt with no room to generate within the model's max positions.
            queue.Full: when `config.max_queue_size` requests are already unfinished (0 = unbounded).
            EngineStoppedError: after `stop()`.
        """
        self._ensure_running()
        ids = self.encode(prompt, chat)
        eos = self.default_eos if eos_token_id is None else SamplingParams.normalize_eos(eos_token_id)
        sp = SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, eos_token_ids=eos, ignore_eos=ignore_eos)
        cap = None
        if self.max_positions:
            cap = self.max_positions - len(ids)
            if cap < 1:
                raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate: the model's max "
                                 f"positions are {self.max_positions}")
            if max_new_tokens is not None and max_new_tokens > cap:
                sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": cap})
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, sp, max_new_tokens_cap=cap)
        handle = RequestHandle(self, req)
        with self._state_lock:
            if self._state != "running":
                self._ensure_running()  # raises: the loop stopped between the check above and now
            with self._handles_lock:
                if rid in self._handles:
                    raise ValueError(f"request_id {rid!r} is already in use")
                limit = self.config.max_queue_size
                if limit and len(self._handles) >= limit:
                    raise queue.Full(f"{len(self._handles)} requests are unfinished and max_queue_size is {limit}: "
                                     "wait for some to finish or raise ContinuousBatchingConfig.max_queue_size")
                self._handles[rid] = handle
            self._post(("submit", req))
        return handle

    def generate(self, prompts: Iterable[Any], max_new_tokens: int | None = None, *, timeout: float | None = None,
                 **sampling: Any) -> list[RequestOutput]:
        """Submit every prompt and wait: one `RequestOutput` per prompt, in input order.

        Args:
            prompts: a list of prompts, each what `submit` takes (text, token ids, chat messages).

        Raises:
            TypeError: `prompts` is a single string (wrap it in a list, or use `submit`).
            ValueError: a bad prompt or sampling value (as `submit`); the prompts submitted before it are cancelled.
            TimeoutError: when `timeout` seconds pass before all are done.
        """
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate() takes a list of prompts, not one string: use generate([prompt]) or "
                            "submit(prompt)")
        handles = []
        try:
            for p in prompts:
                handles.append(self.submit(p, max_new_tokens=max_new_tokens, **sampling))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        deadline = None if timeout is None else time.monotonic() + timeout
        outs = []
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            outs.append(h.result(left))
        return outs

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state (its blocks are freed at the next loop turn). False if unknown/done."""
        with self._handles_lock:
            h = self._handles.get(request_id)
        if h is None or h.done():
            return False
        self._post(("cancel", request_id))
        return True

    def reconfigure(self, config: ContinuousBatchingConfig, timeout: float | None = 60.0) -> ContinuousBatchingConfig:
        """Apply a new config between runs. Unfinished requests are kept: they restart from their prompt and the
        tokens generated so far (their KV is recomputed in the new cache). Returns the resolved config.

        Raises:
            ValueError / MemoryError: when the new config cannot be applied (the old one stays in force).
        """
        if not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        # Cheap checks before anything changes (sizing itself happens once the old pool is freed).
        layout_for(self._spec, torch.tensor([], dtype=self.dtype).element_size(), config.resolve(self.device.type).page_size)
        if self._state != "running":
            self._rebuild(config)
            return self.config
        done = threading.Event()
        box: dict[str, Any] = {}
        self._post(("reconfigure", config, done, box))
        if not done.wait(timeout):
            raise TimeoutError("reconfigure did not complete")
        if "error" in box:
            raise box["error"]
        return self.config

    def _rebuild(self, config: ContinuousBatchingConfig) -> None:
        carry = []
        for req in list(self.core.requests.values()):
            self.core.cache.release(req)
            if req.state != RequestState.PENDING:
                req.transition(RequestState.PENDING)
            req.num_computed = 0
            req.pending_samples = 0
            req.swapped = False
            carry.append(req)
        was_active = self.runner._previous_impl is not None
        self.runner.deactivate()
        old = self.user_config
        # Free the old pool first: sizing measures free memory, and on a GPU the old pool would take most of it.
        self.store = None
        self.runner.store = None
        self.cache = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self._build(config, carry)
        except BaseException:
            self._build(old, carry)  # the old config stays in force; requests are kept
            raise
        finally:
            if was_active:
                self.runner.activate()

    # ------------------------------------------------------------------------------------------ loop
    def _post(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wakeup.set()

    def _on_terminal(self, req: Request) -> None:
        self.runner.forget(req.request_id)
        self._run_stats.on_done(req)
        self._total_stats.on_done(req)
        if self.telemetry:
            self._emit_transitions(req, final=True)
            tm = req.timings
            self._ev.append(RequestDone(self.core.step_id, time.perf_counter(), req.request_id, req.state.name,
                                        len(req.output_ids), req.error, tm.ttft_s, tm.e2e_s, tm.queue_s,
                                        req.prefix_cached_tokens, req.num_offloads, req.num_soft_resets))
        self._emitted.pop(req.request_id, None)
        out = req.output()
        self._recent.append(out)
        with self._handles_lock:
            h = self._handles.pop(req.request_id, None)
        if h is not None:
            h._finish(out)

    def _drain(self) -> bool:
        """Apply queued messages. Returns False when the loop must exit now."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            kind = msg[0]
            if kind == "submit":
                req = msg[1]
                if self.telemetry:
                    self._ev.append(RequestAdded(self.core.step_id, time.perf_counter(), req.request_id,
                                                 len(req.prompt_ids), req.max_new_tokens))
                self.core.add(req)
            elif kind == "cancel":
                self.core.cancel(msg[1])
            elif kind == "reconfigure":
                _, config, done, box = msg
                try:
                    self._rebuild(config)
                except BaseException as e:  # keep the engine alive with the old config
                    box["error"] = e
                done.set()
            elif kind == "stop":
                self._stop_mode = msg[1]

    def _loop(self) -> None:
        failures = 0
        # Async batching (a runner with `async_mode`, i.e. the CUDA runner with graphs): step N+1 is scheduled and
        # launched before step N is collected and applied, so the host prepares N+1 while the device computes N.
        # `inflight` is the launched, unapplied step: (work, handle, t0). Messages (submit, cancel, reconfigure,
        # stop) are only drained when no step is in flight, so everything they touch sees applied state.
        from .events import CudaGraph

        inflight: tuple | None = None
        last_end = 0.0

        def fail_step(work: StepWork, e: Exception) -> bool:
            """Fail a step's requests; True when the engine must die (too many consecutive failures)."""
            nonlocal failures
            with self._mutex:
                self.core.fail_batch(work, e)
            failures += 1
            if failures >= MAX_CONSECUTIVE_FAILURES:
                self._loop_error = f"{failures} consecutive failed steps; last: {type(e).__name__}: {e}"
                self.error = e
                self._state = "dead"
                return True
            return False

        def apply_step(work: StepWork, result: Any, t0: float, t1: float) -> None:
            nonlocal last_end
            with self._mutex:
                updated = self.core.apply(work, result.tokens)
                for req in updated:
                    if not req.is_terminal:
                        with self._handles_lock:
                            h = self._handles.get(req.request_id)
                        if h is not None:
                            h._push(req.output_ids[-1:], req.state)
                t2 = time.perf_counter()
                self._record_step(work, result, max(t0, last_end), t1, t2)
                if self.telemetry:
                    for key in getattr(result, "graph_captured", ()) or ():
                        self._ev.append(CudaGraph(work.step_id, t2, "capture", tuple(key)))
                    for key, err in getattr(result, "graph_failed", ()) or ():
                        self._ev.append(CudaGraph(work.step_id, t2, "capture_failed", tuple(key), err))
                last_end = t2

        def finish_inflight() -> bool:
            """Collect and apply the step in flight. True when the engine must die."""
            nonlocal inflight, failures
            work, handle, t0 = inflight
            inflight = None
            try:
                result = self.runner.collect(handle)
            except Exception as e:  # one bad batch fails its requests, not the engine
                return fail_step(work, e)
            failures = 0
            apply_step(work, result, t0, time.perf_counter())
            return False

        try:
            while True:
                self._wakeup.clear()
                self._ev = ev = []
                if inflight is not None and not self._inbox.empty():
                    if finish_inflight():
                        break
                with self._mutex:
                    if inflight is None:
                        self._drain()
                    stop = self._stop_mode == "cancel" or (self._stop_mode == "drain" and not self.core.has_work)
                    has_work = self.core.has_work
                runner = self.runner
                if not getattr(runner, "configured", True):
                    runner.configure(self.config)
                if stop or not has_work:
                    if inflight is not None:
                        dead = finish_inflight()
                        self.events.extend(ev)
                        if dead:
                            break
                        continue
                    self.events.extend(ev)
                    if stop:
                        break
                    self._wakeup.wait(0.5)
                    continue
                t0 = time.perf_counter()
                with self._mutex:
                    work = self.core.schedule()
                    if self.telemetry:
                        ev.insert(0, self._plan_event(work, t0))
                if work.empty and not work.swap_outs:
                    if inflight is not None:  # what blocks scheduling may be the step in flight: apply it, retry
                        dead = finish_inflight()
                        self.events.extend(ev)
                        if dead:
                            break
                        continue
                    self.events.extend(ev)
                    self._wakeup.wait(0.01)
                    continue
                if getattr(runner, "async_mode", False):
                    try:
                        handle = runner.launch(work)
                    except Exception as e:
                        dead = fail_step(work, e)
                        if not dead and inflight is not None:
                            dead = finish_inflight()
                        self.events.extend(ev)
                        if dead:
                            break
                        continue
                    dead = finish_inflight() if inflight is not None else False
                    inflight = (work, handle, t0)
                    self.events.extend(ev)
                    if dead:
                        break
                    continue
                try:
                    result = runner.execute(work)
                except Exception as e:  # one bad batch fails its requests, not the engine
                    dead = fail_step(work, e)
                    self.events.extend(ev)
                    if dead:
                        break
                    continue
                failures = 0
                apply_step(work, result, t0, time.perf_counter())
                self.events.extend(ev)
        except BaseException as e:  # pragma: no cover - last resort, surfaced to callers
            self._loop_error = f"{type(e).__name__}: {e}"
            self.error = e
            self._state = "dead"
        finally:
            with self._state_lock:
                dead = self._state == "dead"
                if not dead:
                    self._state = "stopped"
            reason = f"engine died: {self._loop_error}" if dead else "engine stopped"
            self._ev = ev = []
            if inflight is not None:  # drain the last step in flight (its tokens are applied before cancelling)
                try:
                    finish_inflight()
                except BaseException:  # pragma: no cover - the device is gone; the requests end below anyway
                    inflight = None
            with self._mutex:
                if dead:
                    self.core.fail_all(reason)
                else:
                    self._cancel_all(reason)
                self._drain_leftover(reason)
            self.events.extend(ev)
            self.runner.deactivate()

    # ------------------------------------------------------------------------------------------ telemetry
    def _cache_event(self, kind: str, **kw: Any) -> None:
        step, t = self.core.step_id, time.perf_counter()
        ev = self._ev
        rid = kw.get("request_id", "")
        if kind == "blocks_allocated":
            if any(kw["new_blocks"]):
                ev.append(BlocksAllocated(step, t, rid, kw["new_blocks"], kw["demoted"]))
            for g, dem in enumerate(kw["demoted"]):
                if dem:
                    ev.append(BlocksDemoted(step, t, g, list(dem)))
            if kw["shared"]:
                full = self.cache.full
                ev.append(BlocksShared(step, t, rid, list(kw["shared"]), [full.refcount[b] for b in kw["shared"]]))
        elif kind == "blocks_freed":
            ev.append(BlocksFreed(step, t, rid, [list(f) for f, _ in kw["per_group"]],
                                  [list(c) for _, c in kw["per_group"]]))
        elif kind == "blocks_deduplicated":
            ev.append(BlocksDeduplicated(step, t, rid, list(kw["pairs"])))

    def _emit_transitions(self, req: Request, final: bool = False) -> None:
        if req.is_terminal and not final:
            return  # `_on_terminal` emitted all of its transitions already
        n = self._emitted.get(req.request_id, 1)  # the initial PENDING is announced by RequestAdded
        tr = req.transitions
        if len(tr) <= n:
            return
        step = self.core.step_id
        now = time.perf_counter()
        for i in range(n, len(tr)):
            self._ev.append(StateChange(step, now, req.request_id, tr[i - 1][0].name, tr[i][0].name, tr[i][1]))
        self._emitted[req.request_id] = len(tr)

    def _plan_event(self, work: StepWork, t0: float) -> StepPlanned:
        p = work.plan
        return StepPlanned(
            work.step_id, t0, p.scheduler,
            [(s.request_id, s.phase, s.num_tokens, s.start, s.prefix_hit_tokens) for s in p.scheduled],
            [(k.reason.value, list(k.request_ids), dict(k.detail)) for k in p.skipped],
            [(st.request_id, list(st.blocks_needed), list(st.blocks_available)) for st in p.stalled],
            p.token_budget, p.num_tokens, p.num_prefill_tokens, p.num_decode_tokens, p.cache_budget,
            p.cache_read_tokens, p.request_cap, len(p.scheduled), p.free_fraction, p.safety_margin,
        )

    def _record_step(self, work: StepWork, result: Any, t0: float, t1: float, t2: float) -> None:
        timings = dict(result.timings)
        timings["schedule"] = work.schedule_s
        timings["update"] = t2 - t1
        graph = getattr(result, "graph_counts", (0, 0))
        for st in (self._run_stats, self._total_stats):
            st.on_step(work.plan, work.offloads, len(work.restores), timings, t0, t2, graph)
        if not self.telemetry:
            return
        ev, step = self._ev, work.step_id
        for s in work.plan.scheduled:
            if s.prefix_hit_tokens:
                blocks = s.allocation.prefix.blocks if s.allocation and s.allocation.prefix else []
                ev.append(PrefixHit(step, t0, s.request_id, s.prefix_hit_tokens, list(blocks),
                                    len(s.request.prompt_ids)))
            self._emit_transitions(s.request)
        for d in work.offloads:
            ev.append(Offload(step, t0, d.request.request_id, d.path, d.reason, d.blocks_freed,
                              d.tokens_to_recompute))
            self._emit_transitions(d.request)
        for req, pairs in work.restores:
            ev.append(Restore(step, t0, req.request_id, sum(len(p) for p in pairs)))
        for r in work.failed:
            self._emit_transitions(r)
        ev.append(StepTiming(step, t2, work.schedule_s, timings.get("offload_copy", 0.0), timings.get("prepare", 0.0),
                             timings.get("forward", 0.0), timings.get("sample", 0.0), t2 - t1,
                             work.plan.num_tokens, len(work.plan.scheduled), getattr(result, "backend", "")))
        if t2 - self._kv_sample_t >= 0.2:
            self._kv_sample_t = t2
            usage = kv_usage(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})
            self._run_stats.on_kv(usage)
            self._total_stats.on_kv(usage)

    def stats(self) -> dict[str, Any]:
        """Figures for this run (since `reset_stats()`) and cumulative, plus the memory split (bytes).

        Returns:
            {"run": RunStats.summary(), "cumulative": ..., "memory_bytes": memory_split()}. Names carry units.
        """
        with self._mutex:
            if self.telemetry:
                usage = kv_usage(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})
                self._run_stats.kv_last = dict(usage)
                self._total_stats.kv_last = dict(usage)
            return {"run": self._run_stats.summary(), "cumulative": self._total_stats.summary(),
                    "memory_bytes": self.memory_split()}

    def reset_stats(self) -> None:
        """Start a new run for `stats()["run"]` (the cumulative figures keep counting)."""
        with self._mutex:
            self._run_stats = RunStats()

    def snapshot(self) -> KVSnapshot:
        """The KV page map now: every block's state, refcount, owner and fill (see `cbnb.cache.snapshot`)."""
        with self._mutex:
            return kv_snapshot(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})

    def requests_snapshot(self) -> list[RequestOutput]:
        """Live requests (arrival order) followed by the most recently ended ones (up to 256)."""
        with self._mutex:
            live = sorted(self.core.requests.values(), key=lambda r: r.arrival)
            return [r.output() for r in live] + list(self._recent)

    def _cancel_all(self, reason: str) -> None:
        for req in list(self.core.requests.values()):
            req.error = reason
            self.core.cancel(req.request_id)

    def _drain_leftover(self, reason: str) -> None:
        # Submissions that raced with the stop: end them too, so no handle waits forever.
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "submit":
                req = msg[1]
                req.error = reason
                req.finish_reason = "cancelled"
                req.transition(RequestState.CANCELLED)
                self._on_terminal(req)
            elif msg[0] == "reconfigure":
                msg[3]["error"] = EngineStoppedError(reason)
                msg[2].set()

    # ------------------------------------------------------------------------------------------ introspection
    def memory_split(self) -> dict[str, int]:
        """Bytes by use: weights, kv_cache, activations, logits, cuda_graphs, swap_pool."""
        split = self.memory.split()
        split["swap_pool"] = self.store.swap_bytes if self.store is not None else 0
        return split

    def __repr__(self) -> str:
        c = self.config
        return (f"Engine({type(self.model).__name__}, {self._state}, page_size={c.page_size}, "
                f"num_blocks={c.num_blocks}, max_batch_tokens={c.max_batch_tokens}, scheduler={c.scheduler_type})")
