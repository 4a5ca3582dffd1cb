"""`LoopState`: the engine loop's state and the named phases of one loop turn, for both engines (torch-free).

The phases, which `cbnb.engine.loop.sync_turn` and `async_turn` put in order (on `cbnb.Engine`'s thread, or on the
thread driving a `cbnb.sim.SimEngine`: its inbox, executor and clock are injected, see `cbnb.engine.loop`):

- `begin_turn()`: `drain()` (control messages such as reconfigure, then up to `MAX_SUBMISSIONS_PER_TURN`
  submissions through `EngineCore.add`, then cancellations), then whether to stop, then the
  step mode's hold (below);
- `plan()`: `EngineCore.schedule()` (admission, chunking, prefix hits, offload decisions; the `Recorder` hears the
  plan as the core's observer);
- (the runner runs the step);
- `apply()`: cancellations first, then `EngineCore.apply()` (tokens, finishing), new tokens to the handles,
  `Recorder.step_done`, and the turn's events to the log in one batch; `fail()` when the forward raised;
- `shutdown()`: the loop's end (every request ends; the model's attention is restored).

**Cancellation.** `cancel()` runs on the caller's thread under the state's lock, which every phase that can end a
request holds: it returns True only for a request that has not ended, and records it; every such phase applies the
recorded cancellations first. So once `cancel()` returned True, the request ends CANCELLED, and no token reaches its
handle afterwards, even when its last step was in flight (the step's token for it is dropped at apply).

**Step mode** (teaching). While `paused`, `begin_turn()` keeps draining messages (submissions are admitted and show
as PENDING, cancellations and reconfigures apply) but plans no step, except one per `StepOnce` control
(`Engine.step()`). With `step_rate` set (slow motion), a step is planned at most every 1/`step_rate` seconds. A stop
overrides both. Both loops apply a step in flight before holding (`gated`), so "paused" always means "after the
last step was applied".

**Lifetime.** A `LoopState` holds no reference to its `Engine` (the thread runs `cbnb.engine.loop.run(state)`), so an
Engine nobody references is collected, and its finalizer (`cbnb.engine.loop.finalize`) stops the loop and drops the
pool.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from .handle import HandleTable, RequestHandle
from .inbox import EngineStoppedError, Inbox, Reconfigure, StepOnce
from ..core.plan import StepResult, StepWork
from ..core.requests import Request, RequestState
from ..core.segments import carry_step_id, config_changes, config_values, mark_reconfigure  # noqa: F401 (re-exported)
from ..telemetry.recorder import Recorder
from .step_mode import LoopStepMode

__all__ = ["LoopState", "Step", "MAX_CONSECUTIVE_FAILURES", "REBUILT", "STOPPED", "IDLE", "HELD", "config_changes",
           "config_values"]

MAX_CONSECUTIVE_FAILURES = 3
STOPPED_ERROR = "engine stopped"  # the error of requests a stop() cancelled
STOPPED_MSG = "engine is stopped: call engine.start() (or use `with engine:`) to submit again"
#: What a turn returns besides None (go on): REBUILT (a reconfigure replaced the parts: pick the loop again),
#: STOPPED; and only with the simulator's inbox: IDLE (nothing to run until someone submits) and HELD (the step mode
#: holds and the caller driving the turns wants them back).
REBUILT, STOPPED, IDLE, HELD = "rebuilt", "stopped", "idle", "held"


@dataclass
class Step:
    """A planned step: its work, when planning began (perf_counter seconds), and the runner's launch handle."""

    work: StepWork
    t0: float
    handle: Any = None


class LoopState(LoopStepMode):
    """The engine loop's state and the phases of a turn (see the module docstring).

    Args:
        builder: an `EngineBuilder` (anything with ``build(config, sink=, on_terminal=)`` returning
            `EngineParts`, and ``empty_device_cache()``): builds the parts for a config, at start and on every
            reconfigure. The simulator's is `cbnb.sim.executor.SimBuilder` (its runner: the cost model).
        recorder: the `Recorder` for events and stats (its clock is the loop's: wall or virtual).
        inbox: where submissions and control messages come from (default: a thread's `Inbox`; the simulator's
            `cbnb.sim.arrivals.Arrivals` releases requests by simulated time).
        lock: the RLock every phase that changes state holds (default: a new one).

    Attributes:
        state: "created", "running", "stopped" or "dead" (`error`, `error_text` say why).
        config, user_config, layout, memory, cache, store, runner, core: the parts in use (`EngineParts`).
    """

    def __init__(self, builder: Any, recorder: Recorder, inbox: Any = None, lock: Any = None) -> None:
        self.builder = builder
        self.recorder = recorder
        self.clock = recorder.clock
        self.inbox = Inbox() if inbox is None else inbox
        self.handles = HandleTable()
        self.lock = threading.RLock() if lock is None else lock
        self.recent: deque[Request] = deque(maxlen=256)  # the most recently ended requests
        self.state = "created"
        self.error: BaseException | None = None
        self.error_text: str | None = None
        self.thread: threading.Thread | None = None
        self.inflight: Step | None = None
        self.failures = 0
        self._last_end = 0.0
        self._idle_s = 0.5
        self._blocked: StepWork | None = None  # the last plan that scheduled nothing while requests wait
        self.ended: dict[str, Request] | None = None  # every ended request by id, when the engine keeps them
        self._init_step_mode()
        self.exited = True  # no thread is running `cbnb.engine.loop.run(self)`
        self.release_on_exit = False
        self.user_config = self.config = self.layout = self.memory = None
        self.cache = self.store = self.runner = self.core = None

    # ------------------------------------------------------------------------------------------ parts
    def install(self, config: Any, carry: list[Request] = ()) -> None:
        """Build the parts for `config`; `carry` (unfinished requests of the previous parts) is resumed in them."""
        parts = self.builder.build(config, sink=self.recorder.sink, on_terminal=self._on_terminal)
        previous, previous_core = self.runner, self.core
        for name in ("user_config", "config", "layout", "memory", "cache", "store", "runner", "core"):
            setattr(self, name, getattr(parts, name))
        carry_step_id(previous_core, self.core)
        self.recorder.attach(self.core, self.cache)
        if previous is not None:
            self.runner.inherit(previous)  # seeded requests keep their RNG streams
        for req in carry:
            self.core.add(req, resume=True)

    def rebuild(self, config: Any) -> None:
        """Replace the parts by those of `config`, keeping unfinished requests (they restart from their prompt and
        tokens so far). On failure the previous config is rebuilt and the error raised."""
        carry = self.core.take_unfinished()
        previous = self.runner
        old, before = self.user_config, self.config
        self.runner.release()  # free the old pool first: sizing measures free memory
        self.store = self.cache = None
        self.builder.empty_device_cache()
        try:
            self.install(config, carry)
        except BaseException:
            self.install(old, carry)
            raise
        finally:
            # The new runner takes over before the old one lets go: the model stays routed (its packed CPU weights
            # are kept, not packed again).
            if self.runner is not previous:
                if previous.active:
                    self.runner.activate()
                previous.deactivate()
        mark_reconfigure(self.recorder, before, self.config)

    def release(self) -> None:
        """Drop the parts for good (the engine is gone): the KV pool and the runner's buffers are freed now."""
        with self.lock:
            if self.runner is not None:
                self.runner.deactivate()
                self.runner.release()
            self.recorder.detach()
            self.cache = self.store = self.runner = self.core = None

    # ------------------------------------------------------------------------------------------ API side
    def submit(self, req: Request, handle: RequestHandle) -> None:
        """Queue a request (any thread). Raises `EngineStoppedError`, `queue.Full` or `ValueError` (duplicate id)."""
        limit = self.config.max_queue_size
        self.inbox.submit(req, register=lambda: self.handles.add(handle, limit),
                          wait=threading.current_thread() is not self.thread)  # the loop never waits for itself

    def cancel(self, request_id: str) -> bool:
        """Cancel a request (any thread). True when it had not ended: it will end CANCELLED, with no token
        delivered after this returns; False for an unknown or ended request."""
        with self.lock:
            h = self.handles.get(request_id)
            if h is None or h.done():
                return False
            self.inbox.cancel(request_id)
            return True

    def cancel_all(self) -> int:
        """Cancel every request that has not ended. Returns how many."""
        with self.lock:
            ids = [rid for rid in self.handles.live_ids() if self.cancel(rid)]
        return len(ids)

    # ------------------------------------------------------------------------------------------ phases
    def begin_turn(self) -> str | None:
        """Start a turn with no step in flight: drain the inbox, then say whether the step loop must return
        (REBUILT: the parts were rebuilt, pick the loop again; STOPPED) or go on (None). While the step mode holds
        (paused, or slow motion between steps) it waits here, draining every message that arrives."""
        while True:
            if self.drain():
                end = REBUILT
            elif self.stopping():
                end = STOPPED
            else:
                wait = self._hold()
                if wait is not None:
                    self.recorder.flush()  # what was admitted while holding shows at once
                    if self.inbox.hold(wait):
                        continue
                    return HELD  # (the simulator's caller wants its turn back; the loop still holds)
                end = None
            self.parked.clear()
            return end

    def drain(self) -> bool:
        """Apply queued messages. True when a reconfigure rebuilt the parts (the caller picks its loop again)."""
        self.inbox.wakeup.clear()
        rebuilt = False
        with self.lock:
            for msg in self.inbox.take_controls():
                if isinstance(msg, Reconfigure):
                    try:
                        self.rebuild(msg.config)
                    except BaseException as e:  # the engine goes on with the old config
                        msg.error = e
                    finally:
                        rebuilt = True
                        msg.done.set()
                elif isinstance(msg, StepOnce):
                    self._steps.append(msg)
            self.admit()
        return rebuilt

    def admit(self) -> None:
        """Hand the inbox's submissions to the core (at most `MAX_SUBMISSIONS_PER_TURN`), then apply recorded
        cancellations (under the lock)."""
        with self.lock:
            add = self.core.add
            for req in self.inbox.take_submissions():
                add(req)
            self._settle_cancels()

    def _settle_cancels(self) -> None:
        """Apply recorded cancellations (under the lock). A request still queued keeps its cancellation."""
        for rid in self.inbox.take_cancels():
            if rid in self.core.requests:
                self.core.cancel(rid)
            elif self.handles.get(rid) is not None:
                self.inbox.keep_cancel(rid)

    def stopping(self) -> bool:
        """Whether the loop must end now (with no step in flight)."""
        mode = self.inbox.stop_mode
        if self.state == "dead" or mode == "cancel":
            return True
        return mode == "drain" and not self.core.has_work and not self.inbox.has_submissions()

    def plan(self) -> Step | None:
        """Schedule the next step; None when there is nothing to run now (see `idle`)."""
        with self.lock:
            self._settle_cancels()
            if not self.core.has_work:
                self._idle_s, self._blocked = 0.5, None
                if not self.inbox.upcoming():  # (a simulated single step waits for the next arrival)
                    self._step_done()
                return None
            work = self.core.schedule()  # the recorder hears the plan as the core's observer
            t0 = work.t0
        self._planned(work.step_id)
        if work.empty and not work.swap_outs:
            self._idle_s, self._blocked = 0.01, work  # work, but nothing schedulable now: try again shortly
            self._step_done()
            return None
        return Step(work, t0)

    def idle(self) -> str | None:
        """Flush the turn's events, then the inbox's idle: a thread waits for a message (or a short retry); the
        simulator moves its clock to the next arrival. Returns what the turn returns (None, or IDLE)."""
        self.recorder.flush()
        return self.inbox.idle(self._idle_s, self._blocked)

    def apply(self, step: Step, result: StepResult) -> None:
        """Apply a step's tokens: cancellations first, then the core, the handles, telemetry."""
        t1 = self.clock()
        with self.lock:
            self._settle_cancels()
            if result.prompt_logprobs:
                for s in step.work.plan.scheduled:
                    if s.request.request_id in result.prompt_logprobs:
                        s.request.add_prompt_logprobs(result.prompt_logprobs[s.request.request_id])
            for req in self.core.apply(step.work, result.tokens, result.logprobs, result.invalid):
                if not req.is_terminal:
                    self._stream(req)
            t2 = self.clock()
            self.recorder.step_done(step.work, result, max(step.t0, self._last_end), t1, t2)
            self._last_end = t2
        self.failures = 0
        self.recorder.flush()
        self._step_done()

    def _stream(self, req: Request) -> None:
        """Deliver the request's new tokens that may be streamed (with stop strings: those that cannot be part of
        one) to its handle."""
        end = req.stream_limit
        if end > req.streamed:
            lps = None if req.logprobs is None else req.logprobs[req.streamed:end]
            self.handles.deliver(req.request_id, req.output_ids[req.streamed:end], req.state, lps)
            req.streamed = end

    def fail(self, step: Step, error: Exception) -> bool:
        """Fail a step's requests (its forward raised). True when the engine must die (too many in a row)."""
        with self.lock:
            self._settle_cancels()
            self.core.fail_batch(step.work, error)
        self.failures += 1
        self.recorder.flush()
        self._step_done()
        if self.failures >= MAX_CONSECUTIVE_FAILURES:
            self.die(error, f"{self.failures} consecutive failed steps; last: {type(error).__name__}: {error}")
            return True
        return False

    def finish(self) -> bool:
        """Collect and apply the step in flight. True when the engine must die."""
        step, self.inflight = self.inflight, None
        try:
            result = self.runner.collect(step.handle)
        except Exception as e:  # one bad batch fails its requests, not the engine
            return self.fail(step, e)
        self.apply(step, result)
        return False

    def die(self, error: BaseException, text: str) -> None:
        self.error, self.error_text = error, text
        self.state = "dead"

    # ------------------------------------------------------------------------------------------ the end
    def shutdown(self) -> None:
        """End the loop: finish the step in flight, end every request (CANCELLED, or FAILED when the engine died),
        refuse submissions, restore the model's attention."""
        dead = self.state == "dead"
        if self.inflight is not None:  # its tokens are applied before the requests are cancelled
            try:
                self.finish()
            except BaseException:  # pragma: no cover - the device is gone; the requests end below anyway
                self.inflight = None
        reason = f"engine died: {self.error_text}" if dead else STOPPED_ERROR
        with self.lock:
            self._settle_cancels()
            leftover, controls = self.inbox.close(reason if dead else STOPPED_MSG)
            if dead:
                self.core.fail_all(reason)
            else:
                for req in list(self.core.requests.values()):
                    req.error = reason
                    self.core.cancel(req.request_id)
            self._end_unadmitted(leftover, reason)
            for msg in controls:
                msg.error = EngineStoppedError(reason)
                msg.done.set()
            self._end_steps()
            if not dead:
                self.state = "stopped"
        self.recorder.flush()
        self.runner.deactivate()
        with self.lock:
            self.exited = True
            if self.release_on_exit:
                self.release()

    def _end_unadmitted(self, leftover: list[Request], reason: str) -> None:
        """End the submissions the loop never took: CANCELLED, so no handle waits forever. In bulk, because a
        producer in a tight loop can queue hundreds of thousands before `stop()`: they never reached the core, the
        runner or the event log, so only their handles and the run counters hear of them."""
        for req in leftover:
            req.error = reason
            req.finish_reason = "cancelled"
            req.transition(RequestState.CANCELLED)
        self.recorder.requests_refused(len(leftover))
        self.recent.extend(leftover[-(self.recent.maxlen or 0):])
        self.handles.finish_many(leftover)

    def withdraw(self, req: Request) -> None:
        """End CANCELLED a request the core never took (the simulator's request yet to arrive), announced as any
        ended request (handle, counters, a `RequestDone`)."""
        req.finish_reason = "cancelled"
        req.transition(RequestState.CANCELLED, self.clock())
        self._on_terminal(req)
        self.recorder.flush()

    def _on_terminal(self, req: Request) -> None:
        self.runner.forget(req.request_id)
        self.recorder.request_done(req)
        self.recent.append(req)
        if self.ended is not None:
            self.ended[req.request_id] = req
        self.handles.finish(req)  # its output is built on the caller's side, when asked

