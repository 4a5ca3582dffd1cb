"""The engine loop: one thread, the only writer of engine state, running one of two step loops (torch-free).

A loop turn is a short list of named phases, methods of `StepLoop`:

- `drain()`: control messages (reconfigure), then up to `MAX_SUBMISSIONS_PER_TURN` submissions
  (`Recorder.admit` → `EngineCore.add`), then cancellations;
- `plan()`: `EngineCore.schedule()` (admission, chunking, prefix hits, offload decisions) through `Recorder.plan`;
- the runner: ``execute(work)``, or ``launch(work)`` … ``collect(handle)``;
- `apply()`: cancellations first, then `EngineCore.apply()` (tokens, finishing), new tokens to the handles,
  `Recorder.step_done`, and the turn's events to the log in one batch.

`sync_loop` runs the phases one after the other (the host waits while the device runs the step)::

    host    drain ─ plan N ─┐              ┌─ apply N ─ drain ─ plan N+1 ─┐              ┌─ apply N+1
    device                  └── step N ────┘                              └─ step N+1 ───┘

`async_loop` double-buffers (async batching, a runner with ``async_mode``): step N+1 is planned and launched before
step N is collected and applied, so the host prepares N+1 while the device computes N::

    host    plan N+1 ─ launch N+1 ─ collect N ─ apply N ─ plan N+2 ─ launch N+2 ─ collect N+1 ─ apply N+1
    device  ─── step N ──────────────────┘ ─── step N+1 ──────────────────────────────┘ ─── step N+2 ...

Messages are drained only while no step is in flight, so everything they change sees applied state. `run()` picks
the loop from the runner when the thread starts, and again after a reconfigure rebuilt the runner.

**Cancellation.** `cancel()` runs on the caller's thread under the loop's lock, which every phase that can end a
request holds: it returns True only for a request that has not ended, and records it; every such phase applies the
recorded cancellations first. So once `cancel()` returned True, the request ends CANCELLED, and no token reaches its
handle afterwards, even when its last step was in flight (the step's token for it is dropped at apply).

**Lifetime.** A `StepLoop` holds no reference to its `Engine`, and the thread runs `run(loop)`: an Engine nobody
references is collected, and its finalizer stops the loop and drops the pool (`finalize`).

Later additions (pausing, single steps, a slow-motion cap) belong in `drain()`, the one place a turn starts.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from .handle import HandleTable, RequestHandle
from .inbox import EngineStoppedError, Inbox, Reconfigure
from .plan import StepResult, StepWork
from .requests import Request, RequestState
from .telemetry import Recorder

__all__ = ["StepLoop", "Step", "run", "sync_loop", "async_loop", "finalize", "MAX_CONSECUTIVE_FAILURES"]

MAX_CONSECUTIVE_FAILURES = 3
STOPPED_ERROR = "engine stopped"  # the error of requests a stop() cancelled
STOPPED_MSG = "engine is stopped: call engine.start() (or use `with engine:`) to submit again"
REBUILT, STOPPED = "rebuilt", "stopped"
FINALIZE_JOIN_S = 10.0  # how long a collected Engine's finalizer waits for its thread


@dataclass
class Step:
    """A planned step: its work, when planning began (perf_counter seconds), and the runner's launch handle."""

    work: StepWork
    t0: float
    handle: Any = None


class StepLoop:
    """The loop thread's state and the phases of a turn (see the module docstring).

    Args:
        builder: an `EngineBuilder` (or anything with ``build(config, sink=, on_terminal=)``, `check`,
            `empty_device_cache`): builds the parts for a config, at start and on every reconfigure.
        recorder: the `Recorder` for events and stats.

    Attributes:
        state: "created", "running", "stopped" or "dead" (`error`, `error_text` say why).
        config, user_config, layout, memory, cache, store, runner, core: the parts in use (`EngineParts`).
    """

    def __init__(self, builder: Any, recorder: Recorder) -> None:
        self.builder = builder
        self.recorder = recorder
        self.clock = recorder.clock
        self.inbox = Inbox()
        self.handles = HandleTable()
        self.lock = threading.RLock()
        self.recent: deque[Request] = deque(maxlen=256)  # the most recently ended requests
        self.state = "created"
        self.error: BaseException | None = None
        self.error_text: str | None = None
        self.thread: threading.Thread | None = None
        self.inflight: Step | None = None
        self.failures = 0
        self._last_end = 0.0
        self._idle_s = 0.5
        self._exited = True  # no thread is running run(self)
        self._release_on_exit = False
        self.user_config = self.config = self.layout = self.memory = None
        self.cache = self.store = self.runner = self.core = None

    # ------------------------------------------------------------------------------------------ parts
    def install(self, config: Any, carry: list[Request] = ()) -> None:
        """Build the parts for `config`; `carry` (unfinished requests of the previous parts) is resumed in them."""
        parts = self.builder.build(config, sink=self.recorder.sink, on_terminal=self._on_terminal)
        previous = self.runner
        for name in ("user_config", "config", "layout", "memory", "cache", "store", "runner", "core"):
            setattr(self, name, getattr(parts, name))
        self.recorder.attach(self.core, self.cache)
        if previous is not None:
            self.runner.inherit(previous)  # seeded requests keep their RNG streams
        for req in carry:
            self.recorder.admit(self.core, req, resume=True)

    def rebuild(self, config: Any) -> None:
        """Replace the parts by those of `config`, keeping unfinished requests (they restart from their prompt and
        tokens so far). On failure the previous config is rebuilt and the error raised."""
        carry = self.core.take_unfinished()
        was_active = self.runner.active
        self.runner.deactivate()
        old = self.user_config
        self.runner.release()  # free the old pool first: sizing measures free memory
        self.store = self.cache = None
        self.builder.empty_device_cache()
        try:
            self.install(config, carry)
        except BaseException:
            self.install(old, carry)
            raise
        finally:
            if was_active:
                self.runner.activate()

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
        self.inbox.submit(req, register=lambda: self.handles.add(handle, limit))

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

    def start(self) -> None:
        with self.lock:
            if self.state == "running":
                return
            self.runner.activate()
            self.inbox.reopen()
            self.state = "running"
            self._exited = False
            self.thread = threading.Thread(target=run, args=(self,), name="cbnb-engine", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------------------------------------ phases
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
            for req in self.inbox.take_submissions():
                self.recorder.admit(self.core, req)
            self._settle_cancels()
        return rebuilt

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
                self._idle_s = 0.5
                return None
            work, t0 = self.recorder.plan(self.core)
        if work.empty and not work.swap_outs:
            self._idle_s = 0.01  # work, but nothing schedulable now: try again shortly
            return None
        return Step(work, t0)

    def idle(self) -> None:
        """Flush the turn's events and wait for a message (or a short retry)."""
        self.recorder.flush()
        if not self.inbox.pending():
            self.inbox.wakeup.wait(self._idle_s)

    def apply(self, step: Step, result: StepResult) -> None:
        """Apply a step's tokens: cancellations first, then the core, the handles, telemetry."""
        t1 = self.clock()
        with self.lock:
            self._settle_cancels()
            for req in self.core.apply(step.work, result.tokens):
                if not req.is_terminal:
                    self.handles.deliver(req.request_id, req.output_ids[-1:], req.state)
            t2 = self.clock()
            self.recorder.step_done(step.work, result, max(step.t0, self._last_end), t1, t2)
            self._last_end = t2
        self.failures = 0
        self.recorder.flush()

    def fail(self, step: Step, error: Exception) -> bool:
        """Fail a step's requests (its forward raised). True when the engine must die (too many in a row)."""
        with self.lock:
            self._settle_cancels()
            self.core.fail_batch(step.work, error)
        self.failures += 1
        self.recorder.flush()
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
            for req in leftover:  # submitted but never admitted: they end too, so no handle waits forever
                req.error = reason
                req.finish_reason = "cancelled"
                req.transition(RequestState.CANCELLED)
                self._on_terminal(req)
            for msg in controls:
                msg.error = EngineStoppedError(reason)
                msg.done.set()
            if not dead:
                self.state = "stopped"
        self.recorder.flush()
        self.runner.deactivate()
        with self.lock:
            self._exited = True
            if self._release_on_exit:
                self.release()

    def _on_terminal(self, req: Request) -> None:
        self.runner.forget(req.request_id)
        self.recorder.request_done(req)
        self.recent.append(req)
        self.handles.finish(req)  # its output is built on the caller's side, when asked


# ---------------------------------------------------------------------------------------------- the two loops
def sync_loop(loop: StepLoop) -> str:
    """One step at a time: drain → plan → execute → apply (the first diagram of the module docstring)."""
    while True:
        if loop.drain():
            return REBUILT
        if loop.stopping():
            return STOPPED
        step = loop.plan()
        if step is None:
            loop.idle()
            continue
        try:
            result = loop.runner.execute(step.work)
        except Exception as e:  # one bad batch fails its requests, not the engine
            if loop.fail(step, e):
                return STOPPED
            continue
        loop.apply(step, result)


def async_loop(loop: StepLoop) -> str:
    """Double-buffered: plan and launch N+1, then collect and apply N (the second diagram)."""
    while True:
        if loop.inflight is not None and loop.inbox.pending():
            if loop.finish():  # messages see applied state
                return STOPPED
        if loop.inflight is None:
            if loop.drain():
                return REBUILT
            if loop.stopping():
                return STOPPED
        step = loop.plan()
        if step is None:
            if loop.inflight is None:
                loop.idle()
            elif loop.finish():  # what blocks scheduling may be the step in flight: apply it, retry
                return STOPPED
            continue
        try:
            step.handle = loop.runner.launch(step.work)
        except Exception as e:  # one bad batch fails its requests, not the engine
            if loop.fail(step, e):
                return STOPPED
            step = None
        if loop.inflight is not None and loop.finish():
            return STOPPED
        loop.inflight = step


def run(loop: StepLoop) -> None:
    """The thread's body: the step loop the runner calls for, again after every rebuild, then `shutdown`."""
    try:
        while True:
            runner = loop.runner
            if not runner.configured:
                runner.configure(loop.config)
            step_loop = async_loop if runner.async_mode else sync_loop
            if step_loop(loop) != REBUILT:
                break
    except BaseException as e:  # pragma: no cover - last resort, surfaced to callers
        loop.die(e, f"{type(e).__name__}: {e}")
    finally:
        loop.shutdown()


def finalize(loop: StepLoop) -> None:
    """What happens when an Engine is collected (or the interpreter exits): stop its loop (unfinished requests end
    CANCELLED), wait for its thread, and drop the pool."""
    loop.inbox.request_stop(drain=False)
    t = loop.thread
    if t is not None and t is not threading.current_thread():
        t.join(FINALIZE_JOIN_S)
    with loop.lock:
        if loop._exited:
            loop.release()
        else:  # still running (called on the loop thread itself, or it did not end in time): release at its end
            loop._release_on_exit = True
