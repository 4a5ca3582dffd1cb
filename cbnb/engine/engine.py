"""`Engine`: continuous batching on a background thread, with a thread-safe submit / stream / cancel API.

::

    import cbnb
    engine = cbnb.Engine.from_pretrained("smollm2-135m")
    with engine:
        outs = engine.generate(["Hello", [1, 2, 3]], max_new_tokens=16)   # list[RequestOutput], input order
        handle = engine.submit("Tell me a story", max_new_tokens=64, do_sample=True, temperature=0.7)
        for delta in handle:                                             # streamed TokenDelta; `async for` too
            print(delta.text, end="")

This module is the model half of the public API; the lifecycle it shares with `cbnb.sim.SimEngine` (generate,
cancel_all, step mode, stats, snapshot, explain, serve) is `cbnb.engine.shell.EngineShell`. The work is split by job:
`cbnb.engine.loop` (the engine thread and its sync / async step loops), `cbnb.engine.phases` (the loop's state and the
phases of a turn), `cbnb.engine.inbox` (messages to the loop), `cbnb.engine.handle` (request handles and streaming),
`cbnb.engine.prompts` (prompt forms and request arguments), `cbnb.telemetry.recorder` (events and stats),
`cbnb.engine.build` (cache sizing and the parts of one config), `cbnb.core.engine_core` (the torch-free decisions).

Notebook lifetime: an Engine that nothing references any more (a re-run cell rebinding its name, ``del engine``)
stops by itself: unfinished requests end CANCELLED, its KV pool is freed, and the model's attention implementation
comes back once no other engine uses the model. Keep the engine referenced while you use its handles. An interrupt
(KeyboardInterrupt) or a timeout inside `generate()` cancels that call's requests. A served engine
(`engine.serve()`) is held by its running server: it lives until `server.stop()` or `engine.stop()`.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import sys
import threading
import weakref
from typing import Any, Sequence

import torch

from .build import EngineBuilder
from ..core.cache.sizing import MemoryPlan
from ..core.config import ContinuousBatchingConfig
from .handle import RequestHandle, check_timeout
from .inbox import EngineStoppedError, Reconfigure
from .loop import finalize, start as start_loop
from .phases import LoopState
from ..core.generation import REQUEST_ARGS, GenerationDefaults
from .prompts import prompt_ids, prompt_preview, sampling_params
from ..core.requests import Request, SamplingParams
from ..lab.runs import RunLog
from .shell import EngineShell
from .step_mode import ThreadedStepMode
from .stops import StopMatcher
from .structured import request_grammar
from ..telemetry.recorder import Recorder
from ..runner.cpu.openmp import release_after_cells, release_caller_threads

__all__ = ["Engine", "RequestHandle", "EngineStoppedError"]


class Engine(ThreadedStepMode, EngineShell):
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
        generation_config: a transformers `GenerationConfig` (or a dict of its fields) giving every request its
            defaults, as ``init_continuous_batching(generation_config=...)``; None: ``model.generation_config``. A
            request's own arguments override it (`submit`). Logits processors cbnb does not implement follow
            `config.drop_unsupported_processors` (dropped with a warning, or a `ValueError`); see
            `cbnb.core.generation`.
        runs: the run log to keep: a `cbnb.lab.runs.RunLog` (e.g. shared with another engine), or a JSON-lines file
            path to persist it (its entries are loaded first, so a restarted notebook keeps its history; every new
            entry is appended; a file keeps the base config it was started with); None: a fresh in-memory log
            whose base is this engine's first config.

    Attributes:
        config: the resolved config in use (every None filled in for this device: num_blocks, max_batch_tokens,
            CUDA-graph and async flags...).
        user_config: the config as given (or as last passed to `reconfigure`), Nones kept; its `to_code()` is what
            to paste into transformers on another machine, where the Nones resolve for that device.
        runs: the run log (`cbnb.lab.runs.RunLog`): every workload run (`cbnb.lab.tuning.run_workload`) and every
            `reconfigure` (recorded here by the engine itself, `records_reconfigures`), with its config change
            against the log's base. `reset_stats()` is not an entry: it only starts a new `stats()["run"]` window
            (every `run_workload` calls it; the run is the entry). The log is an attribute of this object, so it
            survives `reconfigure`.

    Raises:
        ValueError: for an unsupported model (attention types other than full/sliding), a generation config that
            continuous batching cannot follow (naming the field), or a `runs` file holding a line that is not a
            run-log entry.
        MemoryError: when the cache cannot be sized in the available memory.
    """

    _ids = itertools.count()
    engine_name = "cbnb"

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None,
                 config: ContinuousBatchingConfig | None = None, *, device: torch.device | str | None = None,
                 telemetry: bool = True, event_log_size: int = 100_000, generation_config: Any = None,
                 runs: RunLog | str | os.PathLike | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.telemetry = bool(telemetry)
        self._builder = builder = EngineBuilder(model, device)
        self.device, self.dtype = builder.device, builder.dtype
        self.weight_bytes = builder.weight_bytes
        self.max_positions: int | None = builder.max_positions
        emb = model.get_input_embeddings()
        self.vocab_size = int(getattr(emb, "num_embeddings", builder.spec["vocab_size"]))
        gen = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        self.generation_defaults = GenerationDefaults(gen)
        self.generation_defaults.check((config or ContinuousBatchingConfig()).drop_unsupported_processors)
        self.default_eos = self._default_eos()
        self._loop = LoopState(builder, Recorder(self.telemetry, event_log_size))
        self._loop.install(config or ContinuousBatchingConfig())
        self.runs = runs if isinstance(runs, RunLog) else RunLog(base=self.user_config, path=runs)
        # The loop thread holds the LoopState, never this object: once nobody references the Engine, this stops the
        # loop and frees the pool (also at interpreter exit).
        self._finalizer = weakref.finalize(self, finalize, self._loop)

    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m", config: ContinuousBatchingConfig | None = None, *,
                        dtype: Any = None, device: Any = None, **load_kwargs: Any) -> "Engine":
        """Load a model with `cbnb.load_model(name, ...)` and wrap it in an engine."""
        from .models import load_model

        model, tokenizer = load_model(name, dtype=dtype, device=device, **load_kwargs)
        return cls(model, tokenizer=tokenizer, config=config)

    def _default_eos(self) -> frozenset[int]:
        eos = self.generation_defaults.eos_token_id
        if eos is None:
            gc = getattr(self.model, "generation_config", None)
            eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        return SamplingParams.normalize_eos(eos)

    def plan_memory(self, config: ContinuousBatchingConfig) -> tuple[ContinuousBatchingConfig, MemoryPlan, int]:
        """Resolve `config` for this model and device and size its cache, allocating nothing (`EngineBuilder`).

        Returns:
            (resolved config with num_blocks filled in, the memory plan, host swap pool size).
        """
        return self._builder.plan_memory(config)

    # ------------------------------------------------------------------------------------------ the parts in use
    config = property(lambda self: self._loop.config, doc="The resolved `ContinuousBatchingConfig` in use.")
    user_config = property(lambda self: self._loop.user_config, doc="The config as given (Nones kept).")
    layout = property(lambda self: self._loop.layout, doc="The KV cache geometry (`KVLayout`).")
    memory = property(lambda self: self._loop.memory, doc="The cache's `MemoryPlan` (bytes by use).")
    store = property(lambda self: self._loop.store, doc="The `KVStore` (the KV tensors).")
    _thread = property(lambda self: self._loop.thread)

    @property
    def runner(self) -> Any:
        """The runner executing steps (`cbnb.runner.factory.make_runner`); settable before `start()` (tests)."""
        return self._loop.runner

    @runner.setter
    def runner(self, runner: Any) -> None:
        self._loop.runner = runner

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> str:
        """"created", "running", "stopping" (stop() began: submissions are refused), "stopped" or "dead" (see
        `error`)."""
        s = self._loop.state
        return "stopping" if s == "running" and self._loop.inbox.closed else s

    @property
    def running(self) -> bool:
        return self._loop.state == "running"

    @property
    def error(self) -> BaseException | None:
        """What killed the engine (state "dead"), else None."""
        return self._loop.error

    def start(self) -> "Engine":
        """Start the background loop (no-op when running).

        Raises:
            EngineStoppedError: when the engine died of repeated forward failures (see `engine.error`).
        """
        loop = self._loop
        if loop.state == "dead":
            raise EngineStoppedError(f"engine died: {loop.error_text}")
        if loop.state != "running" and loop.thread is not None:
            loop.thread.join()  # a stop() that timed out: let that thread end first
        start_loop(loop)
        self._release_caller_omp()
        if self.device.type == "cpu":
            release_after_cells()
        return self

    def _release_caller_omp(self) -> None:
        # The caller's idle OpenMP pool slows every parallel region of the engine thread (cbnb.runner.openmp).
        if self.device.type == "cpu" and threading.current_thread() is not self._loop.thread:
            release_caller_threads()

    def stop(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop and join its thread, then stop the engine's HTTP servers (`serve`). From the moment this
        is called, `submit` raises `EngineStoppedError`; everything submitted before ends with a terminal output.

        Args:
            drain: finish every submitted request first (HTTP clients get their whole responses); otherwise
                unfinished requests end CANCELLED (error "engine stopped").
            timeout: seconds to wait for the thread, and then for each server (None: no limit).
        """
        timeout = check_timeout(timeout)
        loop = self._loop
        if loop.state == "running":
            loop.inbox.request_stop(drain)
            t = loop.thread
            if t is not None and t is not threading.current_thread():
                t.join(timeout)
                if not t.is_alive():
                    loop.thread = None
        # After the loop: a drained request's last tokens still reach its HTTP client. Without the server module
        # loaded, nothing was served.
        lifecycle = sys.modules.get("cbnb.server.lifecycle")
        if lifecycle is not None:
            for server in lifecycle.servers_for(self):
                server.stop(timeout)  # uvicorn bounds its own shutdown (graceful_shutdown_s)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(drain=exc_type is None)

    # ------------------------------------------------------------------------------------------ submitting
    def _ensure_running(self) -> None:
        state = self.state
        if state == "created":
            self.start()
        elif state in ("stopped", "stopping"):
            raise EngineStoppedError(f"engine is {state}: call engine.start() (or use `with engine:`) to submit "
                                     "again")
        elif state == "dead":
            raise EngineStoppedError(f"engine died: {self._loop.error_text}")

    def encode(self, prompt: Any, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: text (tokenised; chat template applied when `chat` is True, or when None and the
        tokenizer has one), chat messages, token ids (list/tuple, 1-D tensor or array), or a tokenizer output of
        one row (its attention mask honoured). See `cbnb.engine.prompts`.

        Raises:
            TypeError: a form that is not accepted (bytes, sets, bool or float ids...).
            ValueError: an empty prompt, ids outside [0, vocab_size), several rows, text without a tokenizer.
        """
        return prompt_ids(prompt, tokenizer=self.tokenizer, vocab_size=self.vocab_size, chat=chat)

    def submit(self, prompt: Any, max_new_tokens: int | None = None, do_sample: bool | None = None,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
               request_id: str | None = None, *, ignore_eos: bool | None = None, chat: bool | None = None,
               source: str | None = None, min_p: float | None = None, min_new_tokens: int | None = None,
               min_length: int | None = None, repetition_penalty: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               no_repeat_ngram_size: int | None = None, bad_words_ids: Sequence[Sequence[int]] | None = None,
               sequence_bias: Any = None, logit_bias: dict[int, float] | None = None,
               suppress_tokens: Sequence[int] | None = None, begin_suppress_tokens: Sequence[int] | None = None,
               forced_bos_token_id: int | None = None, forced_eos_token_id: int | Sequence[int] | None = None,
               stop: str | Sequence[str] | None = None, logprobs: int | None = None,
               prompt_logprobs: int | None = None, response_format: dict | None = None,
               json_schema: Any = None) -> RequestHandle:
        """Queue one request; thread-safe, callable from any thread. Starts the engine if it was never started.

        Every generation argument left None takes the engine's default (its `generation_config`, see
        `cbnb.core.generation`), and else greedy decoding with no processor; the neutral value turns a default off
        (``top_k=0``, ``top_p=1.0``, ``repetition_penalty=1.0``...). The order in which processors apply and their
        formulas: `cbnb.core.sampling_params`.

        Args:
            prompt: text, chat messages, token ids or a tokenizer output (see `encode`).
            max_new_tokens: tokens to generate at most; None: up to the model's max positions.
            do_sample, temperature, top_k, top_p, min_p, seed: sampling (greedy by default; a temperature of 0
                or below 1e-5 is greedy; top_k=0 is no top-k).
            eos_token_id: stop id(s); None: the generation config's, else the model's EOS.
            request_id: a unique id (default: "req-N").
            ignore_eos: never stop on EOS (benchmarks).
            chat: apply the chat template to a text prompt (None: when the tokenizer has one).
            source: who sent it (free text, at most `cbnb.core.requests.MAX_SOURCE_CHARS` characters), carried on the
                request's outputs and shown on the dashboard's board; the HTTP server passes "http <host:port>".
                None: a call from Python.
            min_new_tokens, min_length, repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias,
                suppress_tokens, begin_suppress_tokens, forced_bos_token_id, forced_eos_token_id: transformers'
                logits processors (GenerationConfig's names and ranges).
            frequency_penalty, presence_penalty: OpenAI's penalties in [-2, 2], over the generated tokens.
            logit_bias: OpenAI's {token id: bias in [-100, 100]}, added to the logits.
            stop: stop string(s): generation ends when one appears; the output text ends before it (needs a
                tokenizer; see `cbnb.engine.stops`).
            logprobs: 0..20: each token's logprob and that many most likely alternatives (`TokenLogprob`, in the
                output and in every streamed delta); None: only when `config.return_logprobs` (then 0).
            prompt_logprobs: 0..20: every prompt token's logprob under the model's raw distribution (no processors)
                and that many alternatives, in `RequestOutput.prompt_logprobs` (None for the first token). Such a
                request bypasses the prefix cache (a cached position has no logits), so it computes its whole
                prompt; the CPU runner only (the CUDA runner refuses it).
            response_format, json_schema: structured output (`cbnb.engine.structured`): OpenAI's ``response_format``
                (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``), or a
                JSON schema (dict, JSON text or pydantic model class); every token is masked by the grammar.

        Raises:
            TypeError: a prompt form that is not accepted, or a `source` that is not a string.
            ValueError: bad prompt or generation values (the message names the field and its range; token ids in
                the arguments must lie in the vocabulary), a duplicate request_id, a `source` that is too long, or
                a prompt with no room to generate within the model's max positions.
            queue.Full: when `config.max_queue_size` requests are already unfinished (0 = unbounded).
            EngineStoppedError: once `stop()` began, or after the engine died.
        """
        args = {k: v for k, v in locals().items() if k in REQUEST_ARGS}
        if prompt_logprobs is not None and (isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int)
                                            or not 0 <= prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20] or None; got {prompt_logprobs!r}")
        if args["logprobs"] is None and self.config.return_logprobs:
            args["logprobs"] = 0
        self._ensure_running()
        if prompt_logprobs is not None and not getattr(self.runner, "supports_prompt_logprobs", False):
            raise ValueError(f"prompt_logprobs is not supported by this engine's runner ({type(self.runner).__name__}) "
                             "yet")
        ids = self.encode(prompt, chat)
        sp, cap = sampling_params(len(ids), self.generation_defaults.resolve(args), eos_token_id=eos_token_id,
                                  default_eos=self.default_eos, vocab_size=self.vocab_size,
                                  max_positions=self.max_positions)
        if response_format is not None or json_schema is not None:
            sp = dataclasses.replace(sp, grammar=request_grammar(
                self.tokenizer, self.vocab_size, self.default_eos, response_format=response_format,
                json_schema=json_schema))
        stopper = StopMatcher(self.tokenizer, sp.stop) if sp.stop else None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, sp, max_new_tokens_cap=cap, stopper=stopper, source=source)
        req.prompt_text = prompt_preview(prompt)
        if prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_logprobs_k = [], prompt_logprobs
        handle = RequestHandle(req, self.tokenizer, self._loop.cancel)
        self._release_caller_omp()
        self._loop.submit(req, handle)
        return handle

    #: The `submit` keywords this engine honours (`cbnb.engine.engine_like`): all of them.
    submit_keywords = frozenset(inspect.signature(submit).parameters) - {"self"}

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state. True: it ends CANCELLED (blocks freed once) and no token reaches its
        handle after this returns, even when its last step is in flight. False for an unknown or ended id."""
        return self._loop.cancel(request_id)

    def reconfigure(self, config: ContinuousBatchingConfig | None = None, timeout: float | None = 60.0,
                    **changes: Any) -> ContinuousBatchingConfig:
        """Apply a new config now, also while requests run. Unfinished requests are kept: they restart from their
        prompt and the tokens generated so far (their KV is recomputed in the new cache). A `RunStarted` event
        ("reconfigure", the changed fields) marks the change. Returns the resolved config.
        Keywords change fields of a config: ``reconfigure(page_size=32)`` is
        ``reconfigure(self.user_config.copy(page_size=32))``.

        Each successful call appends a "reconfigure" entry to `runs` (old -> new user config; the same config
        again is recorded too: it gives a fresh cache). A refused config records nothing.

        Raises:
            ValueError / MemoryError: when the new config cannot be applied (the old one stays in force).
            TimeoutError: when the loop did not apply it within `timeout` seconds.
        """
        config = self._config_of(config, changes)  # reconfigure(page_size=32): the config in force, changed
        if not isinstance(config, ContinuousBatchingConfig):
            raise ValueError(f"config must be a ContinuousBatchingConfig; got {type(config).__name__}")
        timeout = check_timeout(timeout)
        self._builder.check(config)  # cheap checks before anything changes
        if not config.drop_unsupported_processors:
            self.generation_defaults.check(False)
        loop = self._loop
        old = self.user_config
        if loop.state != "running":
            if loop.thread is not None:
                loop.thread.join()  # a stop that timed out: the thread still owns the parts
            with loop.lock:
                loop.rebuild(config)
        else:
            msg = Reconfigure(config)
            loop.inbox.control(msg)
            if not msg.done.wait(timeout):
                raise TimeoutError("reconfigure did not complete")
            if msg.error is not None:
                raise msg.error
        self._reconfigured(old)
        return self.config

    # ------------------------------------------------------------------------------------------ introspection
    def _untaken(self) -> list[Request]:
        return self._loop.inbox.untaken()

    def _swap_bytes(self) -> int:
        return self.store.swap_bytes if self.store is not None else 0

    def __repr__(self) -> str:
        c = self.config
        return (f"Engine({type(self.model).__name__}, {self.state}, page_size={c.page_size}, "
                f"num_blocks={c.num_blocks}, max_batch_tokens={c.max_batch_tokens}, scheduler={c.scheduler_type})")

