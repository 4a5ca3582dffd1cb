"""The engine thread: one thread, the only writer of engine state, running one of two step loops (torch-free).

A turn is the named phases of `cbnb.engine.phases.LoopState` (`begin_turn`, `plan`, the runner, `apply`); the two loops
only put them in order.

`sync_loop` runs them one after the other (the host waits while the device runs the step)::

    host    drain ─ plan N ─┐              ┌─ apply N ─ drain ─ plan N+1 ─┐              ┌─ apply N+1
    device                  └── step N ────┘                              └─ step N+1 ───┘

`async_loop` double-buffers (async batching, a runner with ``async_mode``): step N+1 is planned and launched before
step N is collected and applied, so the host prepares N+1 while the device computes N::

    host    plan N+1 ─ launch N+1 ─ collect N ─ apply N ─ plan N+2 ─ launch N+2 ─ collect N+1 ─ apply N+1
    device  ─── step N ──────────────────┘ ─── step N+1 ──────────────────────────────┘ ─── step N+2 ...

Messages are drained only while no step is in flight, so everything they change sees applied state. `run()` picks
the loop from the runner when the thread starts, and again after a reconfigure rebuilt the runner. The step mode
(pausing, single steps, the slow-motion cap) lives in `LoopState.begin_turn()`, where every turn with no step in
flight starts, in both loops; the async loop applies its step in flight first whenever the step mode may hold.
"""

from __future__ import annotations

import threading

from .phases import REBUILT, STOPPED, LoopState

__all__ = ["start", "run", "sync_loop", "async_loop", "finalize"]

FINALIZE_JOIN_S = 10.0  # how long a collected Engine's finalizer waits for its thread


def start(state: LoopState) -> None:
    """Start the engine thread, running `run(state)` (no-op while it runs)."""
    with state.lock:
        if state.state == "running":
            return
        state.runner.activate()
        state.inbox.reopen()
        state.state = "running"
        state.exited = False
        state.thread = threading.Thread(target=run, args=(state,), name="cbnb-engine", daemon=True)
        state.thread.start()


# ---------------------------------------------------------------------------------------------- the two loops
def sync_loop(state: LoopState) -> str:
    """One step at a time: drain → plan → execute → apply (the first diagram of the module docstring)."""
    while True:
        end = state.begin_turn()
        if end is not None:
            return end
        step = state.plan()
        if step is None:
            state.idle()
            continue
        try:
            result = state.runner.execute(step.work)
        except Exception as e:  # one bad batch fails its requests, not the engine
            if state.fail(step, e):
                return STOPPED
            continue
        state.apply(step, result)


def async_loop(state: LoopState) -> str:
    """Double-buffered: plan and launch N+1, then collect and apply N (the second diagram)."""
    while True:
        if state.inflight is not None and (state.inbox.pending() or state.gated):
            if state.finish():  # messages (and the step mode) see applied state
                return STOPPED
        if state.inflight is None:
            end = state.begin_turn()
            if end is not None:
                return end
        step = state.plan()
        if step is None:
            if state.inflight is None:
                state.idle()
            elif state.finish():  # what blocks scheduling may be the step in flight: apply it, retry
                return STOPPED
            continue
        try:
            step.handle = state.runner.launch(step.work)
        except Exception as e:  # one bad batch fails its requests, not the engine
            if state.fail(step, e):
                return STOPPED
            step = None
        if state.inflight is not None and state.finish():
            return STOPPED
        state.inflight = step


def run(state: LoopState) -> None:
    """The thread's body: the step loop the runner calls for, again after every rebuild, then `shutdown`."""
    try:
        while True:
            runner = state.runner
            if not runner.configured:
                runner.configure(state.config)
            step_loop = async_loop if runner.async_mode else sync_loop
            if step_loop(state) != REBUILT:
                break
    except BaseException as e:  # pragma: no cover - last resort, surfaced to callers
        state.die(e, f"{type(e).__name__}: {e}")
    finally:
        state.shutdown()


def finalize(state: LoopState) -> None:
    """What happens when an Engine is collected (or the interpreter exits): stop its loop (unfinished requests end
    CANCELLED), wait for its thread, and drop the pool."""
    state.inbox.request_stop(drain=False)
    t = state.thread
    if t is not None and t is not threading.current_thread():
        t.join(FINALIZE_JOIN_S)
    with state.lock:
        if state.exited:
            state.release()
        else:  # still running (called on the loop thread itself, or it did not end in time): release at its end
            state.release_on_exit = True
