"""The engine loop, for both engines: the turn functions, and the engine thread that runs them (torch-free).

A turn is the named phases of `cbnb.engine.phases.LoopState` (`begin_turn`, `plan`, the runner, `apply`);
`sync_turn` and `async_turn` only put them in order, and `turn` picks one from the runner. They drive both engines;
what differs is injected into the `LoopState`: the executor (the model runner, or the simulator's cost model,
`cbnb.sim.executor.SimExecutor`, whose ``execute`` / ``launch`` / ``collect`` move a virtual clock by the step's host
and device seconds), the clock (the recorder's: wall or virtual) and the inbox (a thread's `cbnb.engine.inbox.Inbox`,
whose idle waits for a message; the simulator's `cbnb.sim.arrivals.Arrivals`, which releases requests by simulated
time and whose idle moves the clock to the next arrival). Who runs the turns: `cbnb.Engine`'s thread (`run`, below:
`sync_loop` / `async_loop` turn until a reconfigure or a stop), or for `cbnb.sim.SimEngine` the caller's thread
(`run`, `run_until`, a handle's `result()`, `step()`) or its playback thread (`cbnb.sim.driving`,
`cbnb.sim.playback`), which also stop when a turn returns IDLE or HELD.

`sync_turn` runs them one after the other (the host waits while the device runs the step)::

    host    drain ─ plan N ─┐              ┌─ apply N ─ drain ─ plan N+1 ─┐              ┌─ apply N+1
    device                  └── step N ────┘                              └─ step N+1 ───┘

`async_turn` double-buffers (async batching, a runner with ``async_mode``): step N+1 is planned and launched before
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

__all__ = ["start", "run", "turn", "sync_turn", "async_turn", "sync_loop", "async_loop", "finalize"]

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
def sync_turn(state: LoopState) -> str | None:
    """One turn of the synchronous loop: drain → plan → execute → apply (the first diagram of the module
    docstring). Returns None to go on, or what ends the turns (REBUILT, STOPPED; the simulator's IDLE, HELD)."""
    end = state.begin_turn()
    if end is not None:
        return end
    step = state.plan()
    if step is None:
        return state.idle()
    try:
        result = state.runner.execute(step.work)
    except Exception as e:  # one bad batch fails its requests, not the engine
        return STOPPED if state.fail(step, e) else None
    state.apply(step, result)
    return None


def async_turn(state: LoopState) -> str | None:
    """One turn of the double-buffered loop: plan and launch N+1, then collect and apply N (the second diagram).
    Returns as `sync_turn`."""
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
            return state.idle()
        # what blocks scheduling may be the step in flight: apply it, retry
        return STOPPED if state.finish() else None
    try:
        step.handle = state.runner.launch(step.work)
    except Exception as e:  # one bad batch fails its requests, not the engine
        if state.fail(step, e):
            return STOPPED
        step = None
    if state.inflight is not None and state.finish():
        return STOPPED
    state.inflight = step
    return None


def turn(state: LoopState) -> str | None:
    """One turn of the loop the runner calls for (what the simulator's caller and playback thread run)."""
    return async_turn(state) if state.runner.async_mode else sync_turn(state)


def sync_loop(state: LoopState) -> str:
    """Turns of `sync_turn` until one ends the loop (REBUILT or STOPPED)."""
    while True:
        end = sync_turn(state)
        if end is not None:
            return end


def async_loop(state: LoopState) -> str:
    """Turns of `async_turn` until one ends the loop (REBUILT or STOPPED)."""
    while True:
        end = async_turn(state)
        if end is not None:
            return end


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
