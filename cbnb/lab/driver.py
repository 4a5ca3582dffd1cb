"""The driver: submits a workload's requests at their arrival times and records each request's latencies.

::

    from cbnb.lab.driver import Driver
    records = Driver(engine, workload).run()           # blocks until every request is terminal
    d = Driver(engine, workload).start(); ...; d.wait()  # or in the background (the notebook stays free)

The engine protocol: what the driver reads from an engine-like object (`cbnb.Engine` and `cbnb.sim.SimEngine`
implement it, as part of `cbnb.engine.engine_like.EngineLike`; `cbnb.bench.engine_peer.HFContinuousBatching` too). Nothing else
is touched.

- ``engine.submit(prompt, max_new_tokens=n, **submit_kwargs) -> handle``: one call per request, at its arrival
  time, in arrival order; `prompt` is the workload's prompt as stored (token ids or text), `submit_kwargs` default
  to ``{"ignore_eos": True}``. Called on the driver's thread (wall clock) or the caller's (virtual clock). An
  exception refuses that request only (recorded FAILED with the message).
- ``handle.result(timeout)``: the final output; `timeout` in wall seconds or None; raising ``TimeoutError`` makes
  the driver cancel what is left. It is called only once every request was submitted (and, on a virtual clock,
  after ``clock.drain()``), so by then it may simply return; the one exception is the closed loop on a virtual
  clock, which calls ``result(0)`` on a handle whose ``done()`` is True to read its end time.
- optional on the handle: ``request_id`` (str), ``done() -> bool``, ``cancel()`` (used on timeout).
- the output: ``token_ids`` (list of int) and ``state`` (an enum member whose ``.name``, or a str, is one of
  "FINISHED", "FAILED", "CANCELLED"); optional: ``error`` (str), ``timings`` with ``queued``, ``scheduled``,
  ``first_token``, ``finished`` (seconds on the driver's clock, or None), ``token_times`` (one time per token, same
  clock; ignored unless there is one per token), ``prefix_cached_tokens``, ``num_offloads``, ``num_soft_resets``,
  ``prompt_token_ids``.

The engine's times must be on the driver's clock: ``time.perf_counter()`` with the default `WallClock`, the
simulator's virtual seconds with its clock. What `cbnb.lab.tuning` needs besides this is listed in that module's doc.

Clocks. The driver reads time from a clock (``now()``, ``sleep_until(t)``):

- `WallClock` (default): ``time.perf_counter()``, the real engine's timebase. The driver submits from its own thread
  (``cbnb-driver``) and never before a request's arrival time: it sleeps until the clock reads at least
  ``t0 + arrival_s`` and only then submits, so lateness (submitted - scheduled) is never negative.
- a virtual clock (``threaded = False``): the driver runs in the caller's thread, in this order: ``t0 = now()``;
  then per request, in arrival order, ``sleep_until(t0 + arrival_s)`` (the simulator advances virtual time to
  that instant, running every step due before it), ``now()`` (the submit time recorded), ``engine.submit(...)``;
  after the last one, ``drain()`` (run until every submitted request is terminal); then ``handle.result`` for
  each. ``sleep_until`` must never return with ``now()`` below its target.

Per-request figures (`RequestRecord`, seconds, relative to the run's start ``t0``):

- TTFT: queued -> first token; TPOT: (last token - first token) / (output tokens - 1), vLLM's definition;
- ITL: the gaps between consecutive tokens of a request (from ``token_times``; empty without them);
- queue: queued -> first scheduled; e2e: queued -> terminal; lateness: submitted - arrival time.

"queued" is the engine's own mark (``timings.queued``, set inside ``submit``); when an engine has no timings the
driver's submit time stands in.

Closed loop (``max_concurrency=C``): at most C requests are in flight (submitted, not terminal); request *i* (in
arrival order) is submitted at ``max(t0 + arrival_s, the instant a slot frees)``, so with every arrival at 0 the next
request starts when one ends, as ``vllm bench serve --max-concurrency C`` (a semaphore around each request, with
``--request-rate`` still spacing the arrivals) and GuideLLM's ``concurrent`` profile do. It needs ``handle.done()``.

- wall clock: the driver thread waits for a handle to end, woken by the engine's ``events`` (an `EventLog` with
  ``subscribe``: any "request_done" record) or, without one, by polling every `POLL_S` seconds;
- virtual clock: the driver advances the simulation in the smallest steps it can (``clock.advance()`` when the clock
  has it; else ``clock.sleep_until(max(clock.now(), engine.now) + tiny)``, which runs the one step that starts at
  the engine's clock), and when a request has ended it moves its present to that request's ``timings.finished``
  (``sleep_until``) and submits there: the next request arrives at the very instant the last token was delivered,
  as a client with zero network latency would send it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["Clock", "WallClock", "Driver", "RequestRecord", "POLL_S", "on_stop", "announce_stop", "stop_guard"]

#: Wall seconds between checks for a free slot (closed loop) when the engine has no event log to wake the driver.
POLL_S = 0.02

_stop_listeners: list[Any] = []  # weak references to callables (engine, message), e.g. a dashboard's


def on_stop(callback: Any) -> None:
    """Call ``callback(engine, message)`` whenever a driven run is stopped early (an interrupt, a timeout, an
    error) and has cancelled its requests; `message` is the one line it printed. Held weakly (a bound method keeps
    no dashboard alive); a callback that raises is ignored."""
    import weakref

    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
    _stop_listeners[:] = [r for r in _stop_listeners if r() is not None] + [ref]


def _why(exc: BaseException) -> str:
    return {KeyboardInterrupt: "interrupted", TimeoutError: "timed out"}.get(type(exc), f"stopped by {type(exc).__name__}")


def announce_stop(engine: Any, exc: BaseException, message: str) -> None:
    """Say once, for `exc`, that a run was stopped: `message` on stderr, as a note on `exc`, and to the `on_stop`
    listeners (a dashboard shows it). Later calls for the same exception do nothing (an outer helper does not say
    it again)."""
    if getattr(exc, "_cbnb_stop_said", False):
        return
    try:
        exc.add_note(message)
        exc._cbnb_stop_said = True  # type: ignore[attr-defined]
        # IPython renders an exception with this method instead of its traceback: a stopped cell shows one line
        # next to the message, not the ~40 lines of engine internals the interrupt happened to land in. Only under
        # IPython: the method cannot be pickled (a process pool's worker sends its exceptions back pickled).
        if _in_ipython():
            exc._render_traceback_ = lambda: [_short_stop(exc)]  # type: ignore[attr-defined]
    except Exception:  # an exception type that takes no attributes
        pass
    import sys

    print(message, file=sys.stderr, flush=True)
    _tell_stop(engine, message)


def _in_ipython() -> bool:
    """An IPython shell runs in this process (a notebook's kernel, the ipython REPL)."""
    import sys

    ip = sys.modules.get("IPython")
    try:
        return ip is not None and ip.get_ipython() is not None
    except Exception:
        return False


def _short_stop(exc: BaseException) -> str:
    """The line IPython shows for a stop cbnb announced, e.g. "KeyboardInterrupt: the cell was stopped (cbnb's
    line above says what it cancelled)"."""
    why = "the cell was stopped" if isinstance(exc, KeyboardInterrupt) else (str(exc) or "timed out")
    return f"{type(exc).__name__}: {why} (cbnb's line above says what it cancelled)"


class stop_guard:
    """``with stop_guard(engine, "sweep"):`` around a helper that drives runs: an interrupt or a timeout that lands
    between its runs (a reconfigure, a warm-up, which cancels its own request) is said in one line too, as a
    driven run says it (`announce_stop`)."""

    def __init__(self, engine: Any, what: str) -> None:
        self.engine, self.what = engine, what

    def __enter__(self) -> "stop_guard":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, (KeyboardInterrupt, TimeoutError)):
            announce_stop(self.engine, exc, f"cbnb: {self.what} {_why(exc)} between its runs: it left no request "
                                            "running.")
        return False


def _tell_stop(engine: Any, message: str) -> None:
    for ref in list(_stop_listeners):
        cb = ref()
        if cb is not None:
            try:
                cb(engine, message)
            except Exception:
                pass


class Clock(Protocol):
    """What the driver needs from a clock. `threaded` False: virtual time, driven from the caller's thread."""

    threaded: bool

    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...

    def drain(self) -> None: ...


class WallClock:
    """Real time: ``time.perf_counter()`` seconds (the same clock as the engine's request timings)."""

    threaded = True

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, t: float, stop: threading.Event | None = None) -> None:
        """Return once ``now() >= t`` (never earlier), or as soon as `stop` is set."""
        while True:
            left = t - time.perf_counter()
            if left <= 0:
                return
            # Sleep in slices so a stop request is seen; the last slice ends at t (time.sleep never returns early
            # on Linux, and the loop re-checks anyway).
            if stop is not None:
                if stop.wait(min(left, 0.05)):
                    return
            else:
                time.sleep(min(left, 0.05))

    def drain(self) -> None:
        """Nothing to do: the engine runs on its own thread."""


@dataclass
class RequestRecord:
    """One request of a driven run. Times in seconds from the run's start; None when not reached."""

    index: int
    request_id: str | None
    arrival_s: float
    submitted_s: float | None = None
    prompt_tokens: int | None = None
    max_new_tokens: int = 0
    state: str = "PENDING"
    error: str | None = None
    output_tokens: int = 0
    queued_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prefix_cached_tokens: int = 0
    num_offloads: int = 0
    num_soft_resets: int = 0

    @property
    def finished(self) -> bool:
        return self.state == "FINISHED"

    @property
    def lateness_s(self) -> float | None:
        return None if self.submitted_s is None else self.submitted_s - self.arrival_s

    def _since_queued(self, t: float | None) -> float | None:
        s = self.queued_s if self.queued_s is not None else self.submitted_s
        return None if s is None or t is None else t - s

    ttft_s = property(lambda self: self._since_queued(self.first_token_s), doc="queued -> first token (s).")
    e2e_s = property(lambda self: self._since_queued(self.finished_s), doc="queued -> terminal (s).")
    queue_s = property(lambda self: self._since_queued(self.scheduled_s), doc="queued -> first scheduled (s).")

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (n - 1); None for fewer than 2 tokens."""
        if self.output_tokens < 2 or self.first_token_s is None:
            return None
        last = self.token_times_s[-1] if len(self.token_times_s) == self.output_tokens else self.finished_s
        return None if last is None else (last - self.first_token_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self, tokens: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not tokens:
            d.pop("token_ids")
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s, queue_s=self.queue_s,
                 lateness_s=self.lateness_s)
        return d


def _rel(t: Any, t0: float) -> float | None:
    return None if t is None else float(t) - t0


class Driver:
    """Submit `workload`'s requests at their arrival times and record what happened to each.

    Args:
        engine: an engine-like object (see the module doc); it must be started or start on submit.
        workload: a `cbnb.lab.workloads.Workload` (prompts, max_new_tokens, arrival_s).
        clock: a `WallClock` (default) or a virtual clock (``threaded = False``).
        submit_kwargs: extra keyword arguments for every ``submit`` (default: ``ignore_eos=True``, greedy).
        time_scale: multiply arrival times by this (e.g. 0.5 plays the trace twice as fast).
        max_concurrency: at most this many requests in flight (closed loop, see the module doc); None: open loop
            (every request at its arrival time).

    Attributes:
        records: one `RequestRecord` per request, in workload order (filled as requests end).
        t0: the clock reading at the start (arrival times are relative to it).
        error: the exception that stopped the driver thread early, if any.

    A request that `submit` refuses (a bad prompt, a full queue) is recorded FAILED with the error; the others go
    on. Nothing is submitted before its arrival time.
    """

    def __init__(self, engine: Any, workload: Any, *, clock: Any = None, submit_kwargs: dict[str, Any] | None = None,
                 time_scale: float = 1.0, max_concurrency: int | None = None) -> None:
        if not (isinstance(time_scale, (int, float)) and time_scale > 0):
            raise ValueError(f"time_scale must be a number > 0; got {time_scale!r}")
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool)
                                            or max_concurrency < 1):
            raise ValueError(f"max_concurrency must be an integer >= 1 or None; got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        self.engine = engine
        self.workload = workload
        self.clock = clock if clock is not None else WallClock()
        if not isinstance(getattr(self.clock, "threaded", None), bool):
            raise TypeError("clock must have a bool `threaded` (see cbnb.lab.driver.Clock); got "
                            f"{type(self.clock).__name__}")
        self.submit_kwargs = {"ignore_eos": True, **(submit_kwargs or {})}
        self.time_scale = float(time_scale)
        n = workload.num_requests
        arr = [float(a) * self.time_scale for a in workload.arrival_s]
        self.order = sorted(range(n), key=lambda i: (arr[i], i))
        self.records = [RequestRecord(i, None, arr[i], max_new_tokens=int(workload.max_new_tokens[i]),
                                      prompt_tokens=None if isinstance(workload.prompts[i], str)
                                      else len(workload.prompts[i])) for i in range(n)]
        self.handles: list[Any] = [None] * n
        self.t0: float | None = None
        self.t_end: float | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._submitted = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # closed loop, wall clock: a request ended
        self._inflight: list[int] = []  # closed loop: indices submitted and not seen terminal

    # ------------------------------------------------------------------------------------------ closed loop
    def _free_slot(self) -> None:
        """Block (wall clock) or advance the simulation (virtual clock) until fewer than `max_concurrency`
        requests are in flight."""
        cap, clock = self.max_concurrency, self.clock
        while True:
            self._wake.clear()  # before the check: a request ending after it still wakes the wait below
            ended = [i for i in self._inflight if _done(self.handles[i])]
            if ended:
                gone = set(ended)
                self._inflight = [i for i in self._inflight if i not in gone]
            if len(self._inflight) < cap or self._stop.is_set():
                break
            if clock.threaded:
                self._wake.wait(POLL_S)
            else:
                self._advance()
        if ended and not clock.threaded:
            # Submit at the instant the freeing request ended (its last token), not at the end of the slice run.
            t = max((_finished_at(self.handles[i]) for i in ended), default=None)
            if t is not None:
                clock.sleep_until(t)

    def _advance(self) -> None:
        """Run the simulation by the smallest amount: one step (virtual clock)."""
        clock = self.clock
        adv = getattr(clock, "advance", None)
        if callable(adv):
            adv()
            return
        now = clock.now()
        eng_now = getattr(self.engine, "now", None)
        base = max(now, float(eng_now)) if isinstance(eng_now, (int, float)) else now
        clock.sleep_until(base + 1e-9 * max(1.0, abs(base)))

    def _subscribe(self) -> Any:
        """Wake the closed loop on every "request_done" event of the engine's log; returns the unsubscribe."""
        log = getattr(self.engine, "events", None)
        sub = getattr(log, "subscribe", None)
        if not callable(sub):
            return None
        wake = self._wake

        def on_events(events: list[Any]) -> None:
            if any(getattr(e, "kind", "") == "request_done" for e in events):
                wake.set()

        try:
            return sub(on_events)
        except Exception:  # an engine-like whose log cannot be subscribed to: poll instead
            return None

    # ------------------------------------------------------------------------------------------ submitting
    def _submit_all(self) -> None:
        clock, wl = self.clock, self.workload
        closed = self.max_concurrency is not None
        unsubscribe = self._subscribe() if closed and clock.threaded else None
        try:
            for i in self.order:
                rec = self.records[i]
                target = self.t0 + rec.arrival_s
                if isinstance(clock, WallClock):
                    clock.sleep_until(target, self._stop)
                else:
                    clock.sleep_until(target)
                if closed and not self._stop.is_set():
                    self._free_slot()
                if self._stop.is_set():
                    rec.state, rec.error = "CANCELLED", "driver stopped before this request's arrival"
                    continue
                now = clock.now()
                rec.submitted_s = now - self.t0
                try:
                    h = self.engine.submit(wl.prompts[i], max_new_tokens=int(wl.max_new_tokens[i]),
                                           **self.submit_kwargs)
                except Exception as e:  # one refused request is recorded, the run goes on
                    rec.state, rec.error = "FAILED", f"submit refused: {type(e).__name__}: {e}"
                    continue
                self.handles[i] = h
                rec.request_id = getattr(h, "request_id", None)
                if closed:
                    if not callable(getattr(h, "done", None)):
                        raise TypeError(f"max_concurrency needs handles with done(); {type(h).__name__} has none")
                    self._inflight.append(i)
        except BaseException as e:  # pragma: no cover - surfaced by wait()
            self.error = e
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._submitted.set()

    def start(self) -> "Driver":
        """Start submitting (a background thread on a wall clock; inline, to completion, on a virtual clock)."""
        if self.t0 is not None:
            raise RuntimeError("this driver already ran: make a new Driver for another run")
        self.t0 = self.clock.now()
        if self.clock.threaded:
            self._thread = threading.Thread(target=self._submit_all, name="cbnb-driver", daemon=True)
            self._thread.start()
        else:
            try:
                self._submit_all()
                if isinstance(self.error, (KeyboardInterrupt, SystemExit)):
                    raise self.error  # the caller's thread was interrupted while it drove the simulation
                self.clock.drain()
            except BaseException as e:
                self._stopped(e)
                raise
        return self

    # ------------------------------------------------------------------------------------------ collecting
    def wait(self, timeout: float | None = None) -> list[RequestRecord]:
        """Block until every request is terminal and return the records.

        Raises:
            TimeoutError: after `timeout` seconds (wall time); unfinished requests are cancelled first, so nothing
                keeps running in the engine.
        """
        if self.t0 is None:
            self.start()
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            if not self._submitted.wait(left()):
                raise TimeoutError(f"not every request was submitted within {timeout} s")
            if self.error is not None:
                raise self.error
            for i, h in enumerate(self.handles):
                if h is None:
                    continue
                self._fill(self.records[i], h.result(left()))
        except BaseException as e:  # a timeout, the stop button (KeyboardInterrupt), any error: nothing keeps running
            self._stopped(e)
            raise
        ends = [r.finished_s for r in self.records if r.finished_s is not None]
        self.t_end = self.t0 + max(ends) if ends else self.clock.now()
        return self.records

    def run(self, timeout: float | None = None) -> list[RequestRecord]:
        """`start()` then `wait(timeout)`."""
        return self.start().wait(timeout)

    def cancel(self) -> dict[str, int]:
        """Stop submitting and cancel the submitted requests that are not done.

        Returns:
            {"cancelled": submitted requests asked to cancel, "unsubmitted": requests never submitted,
            "done": submitted requests that had already ended}.
        """
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)  # it sees the stop within a sleep slice: a handle it is being given is cancelled below too
        cancelled = done = 0
        for h in self.handles:
            if h is None:
                continue
            if _done(h):
                done += 1
                continue
            try:
                h.cancel()
            except Exception:
                pass
            cancelled += 1
        unsubmitted = sum(h is None and r.submitted_s is None for h, r in zip(self.handles, self.records))
        return {"cancelled": cancelled, "unsubmitted": unsubmitted, "done": done}

    def _stopped(self, exc: BaseException) -> None:
        """Cancel what this run submitted and say so in one line (stderr, and a note on `exc`)."""
        counts = self.cancel()
        n, left = counts["cancelled"], counts["unsubmitted"]
        announce_stop(self.engine, exc, f"cbnb: run {_why(exc)}: cancelled {n} unfinished request"
                      f"{'' if n == 1 else 's'} it had submitted{f' and {left} not yet submitted' if left else ''} "
                      f"({counts['done']} had ended); the engine keeps none of this run's work.")

    def _fill(self, rec: RequestRecord, out: Any) -> None:
        t0 = self.t0
        state = getattr(out, "state", None)
        rec.state = getattr(state, "name", str(state))
        rec.error = getattr(out, "error", None)
        rec.token_ids = list(getattr(out, "token_ids", []) or [])
        rec.output_tokens = len(rec.token_ids)
        tm = getattr(out, "timings", None)
        if tm is not None:
            rec.queued_s = _rel(getattr(tm, "queued", None), t0)
            rec.scheduled_s = _rel(getattr(tm, "scheduled", None), t0)
            rec.first_token_s = _rel(getattr(tm, "first_token", None), t0)
            rec.finished_s = _rel(getattr(tm, "finished", None), t0)
        times = list(getattr(out, "token_times", []) or [])
        rec.token_times_s = [float(t) - t0 for t in times] if len(times) == rec.output_tokens else []
        if rec.first_token_s is None and rec.token_times_s:
            rec.first_token_s = rec.token_times_s[0]
        rec.prefix_cached_tokens = int(getattr(out, "prefix_cached_tokens", 0) or 0)
        rec.num_offloads = int(getattr(out, "num_offloads", 0) or 0)
        rec.num_soft_resets = int(getattr(out, "num_soft_resets", 0) or 0)
        if rec.prompt_tokens is None:
            rec.prompt_tokens = len(getattr(out, "prompt_token_ids", []) or []) or None

    @property
    def duration_s(self) -> float | None:
        """Start -> the last request's end (seconds), once `wait` returned."""
        return None if self.t_end is None or self.t0 is None else self.t_end - self.t0


def _finished_at(h: Any) -> float | None:
    """The engine's terminal mark of a done handle (its clock's seconds), or None."""
    try:
        tm = getattr(h.result(0), "timings", None)
    except Exception:
        return None
    t = getattr(tm, "finished", None)
    return float(t) if isinstance(t, (int, float)) else None


def _done(h: Any) -> bool:
    d = getattr(h, "done", None)
    try:
        return bool(d()) if callable(d) else False
    except Exception:
        return False
