"""One background poller per dashboard: reads the engine at <= `max_hz` and hands each panel a `Frame`.

Flow::

    engine thread ──EventLog.extend──▶ subscriber: wake.set()   (the only work done on the engine thread)
    poller thread: wait(wake or idle timeout) ─▶ rate limit (>= 1/max_hz since the last tick) ─▶ tick():
        events.since(cursor), requests_snapshot(), stats(), snapshot() [only while a page map is visible]
        ─▶ Frame ─▶ panel._update(frame) for every panel ─▶ traitlets set only when a value changed
        (one comm message per changed panel, stamped with the send time for latency measurements)

The engine never waits on the poller: it only sets an event, and the read-only accessors take the engine's lock
for a short copy. Waking on events (rather than sleeping a fixed period) keeps the event-to-browser delay short when
steps are slow, while the rate limit caps the update rate when they are fast.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

__all__ = ["Frame", "Poller", "PanelLike"]

log = logging.getLogger(__name__)


@dataclass
class Frame:
    """What the engine looked like at one poll.

    Attributes:
        wall: `time.time()` when the frame was read (seconds since the epoch).
        events: new events since the previous frame (`cbnb.telemetry.events.Event`), oldest first.
        dropped: events lost to the log's bound between two frames.
        event_wall: when the oldest new event was published to the log (`time.time()` scale; the engine appends a
            step's events when the step ends), or None without events.
        requests: `engine.requests_snapshot()` (live requests first), or None when no panel asked for it.
        stats: `engine.stats()`, or None when no panel asked for it.
        snapshot: `engine.snapshot()` (KV page map), or None when no page map is visible.
        engine_state: "created", "running", "stopped" or "dead".
    """

    wall: float
    events: list = field(default_factory=list)
    dropped: int = 0
    event_wall: float | None = None
    requests: list | None = None
    stats: dict | None = None
    snapshot: Any = None
    engine_state: str = "created"


class PanelLike(Protocol):
    def _needs(self) -> set[str]: ...

    def _update(self, frame: Frame) -> None: ...


class Poller:
    """Polls one engine for a set of panels on a single daemon thread.

    Args:
        engine: a `cbnb.Engine`.
        panels: panels to feed (more can be added with `add`).
        max_hz: update rate cap (ticks per second), in (0, 10]; the issue's budget is 10 Hz.
        idle_refresh_s: also tick this often when no event arrives (catches changes without telemetry, e.g.
            requests finishing while `engine.telemetry` is off).
        beat_s: send every panel a heartbeat this often (seconds), so that a panel can tell a live kernel, busy
            or not, from a dead one.

    Raises:
        ValueError: for `max_hz` outside (0, 10], or a non-positive `idle_refresh_s` or `beat_s`.
    """

    #: The poller waits this many times its last tick's duration before the next tick (at least 1 / max_hz).
    BUSY_FACTOR = 3.0

    def __init__(self, engine: Any, panels: Iterable[PanelLike] = (), *, max_hz: float = 10.0,
                 idle_refresh_s: float = 1.0, beat_s: float = 2.0) -> None:
        if not (0 < max_hz <= 10):
            raise ValueError(f"max_hz must be in (0, 10]; got {max_hz!r}")
        if not (idle_refresh_s > 0):
            raise ValueError(f"idle_refresh_s must be > 0; got {idle_refresh_s!r}")
        if not (beat_s > 0):
            raise ValueError(f"beat_s must be > 0; got {beat_s!r}")
        self.beat_s = beat_s
        self.engine = engine
        self.panels: list[PanelLike] = list(panels)
        self.min_interval = 1.0 / max_hz
        self.idle_refresh_s = idle_refresh_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe = None
        self._cursor = engine.events.cursor if hasattr(engine, "events") else 0
        self._last_full = 0.0
        self._force = True
        self._published: float | None = None
        self._last_cost = 0.0  # seconds the last tick took
        self.ticks = 0  # frames delivered
        self.tick_seconds = 0.0  # total time spent in tick() (for overhead accounting)
        self.errors: list[str] = []
        self.send_lag: deque[float] = deque(maxlen=2000)  # seconds from engine read to send, per panel update

    # ------------------------------------------------------------------------------------------ lifecycle
    def add(self, panel: PanelLike) -> None:
        """Feed one more panel (from the next tick on)."""
        if panel not in self.panels:
            self.panels.append(panel)
        self.poke()

    def poke(self) -> None:
        """Ask for a full refresh at the next allowed tick (e.g. a page map just became visible)."""
        self._force = True
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Poller":
        """Start the thread (no-op when running)."""
        if self.running:
            return self
        self._stop.clear()
        self._unsubscribe = self.engine.events.subscribe(self._on_events)
        self._thread = threading.Thread(target=self._run, name="cbnb-ui-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and unsubscribe from the engine's events."""
        self._stop.set()
        self._wake.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    close = stop

    # ------------------------------------------------------------------------------------------ thread
    def _on_events(self, _events: list) -> None:
        # Runs on the engine thread: keep it O(1). Remember when the first unread batch was published.
        if self._published is None:
            self._published = time.time()
        self._wake.set()

    def beat(self) -> None:
        """Send every panel a heartbeat now (see `beat_s`)."""
        now = time.time()
        for p in list(self.panels):
            hb = getattr(p, "_heartbeat", None)
            if hb is not None:
                try:
                    hb(now)
                except Exception as e:  # a closed widget: keep beating for the others
                    self.errors = (self.errors + [f"heartbeat: {type(e).__name__}: {e}"])[-10:]

    def _run(self) -> None:
        last = 0.0
        last_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() - last_beat >= self.beat_s:
                last_beat = time.monotonic()
                self.beat()
            self._wake.wait(min(self.idle_refresh_s, self.beat_s))
            if self._stop.is_set():
                break
            # A tick that took T waits BUSY_FACTOR x T before the next one: over a big workload (notebook 05's
            # 600 simulated requests cost ~0.2 s a tick) the panels take at most a quarter of a core, and the
            # cell that drives the engine keeps the rest (the GIL is shared with it).
            wait = max(self.min_interval, self.BUSY_FACTOR * self._last_cost) - (time.monotonic() - last)
            if wait > 0 and self._stop.wait(wait):
                break
            self._wake.clear()
            last = time.monotonic()
            try:
                self.tick()
            except Exception as e:  # never let the poller die silently; keep the last few errors
                msg = f"{type(e).__name__}: {e}"
                self.errors = (self.errors + [msg])[-10:]
                log.exception("cbnb dashboard poll failed")

    # ------------------------------------------------------------------------------------------ one frame
    def tick(self, force: bool = False) -> Frame | None:
        """Read the engine once and update every panel. Callable directly (tests, headless use).

        Returns:
            The frame delivered, or None when nothing changed since the previous one.
        """
        t0 = time.perf_counter()
        eng = self.engine
        published, self._published = self._published, None
        events, cursor, dropped = eng.events.since(self._cursor)
        self._cursor = cursor
        now = time.monotonic()
        force = force or self._force
        telemetry = getattr(eng, "telemetry", True)
        if not (events or dropped or force or not telemetry or now - self._last_full >= self.idle_refresh_s):
            return None
        self._force = False
        self._last_full = now
        needs: set[str] = set()
        for p in self.panels:
            needs |= p._needs()
        wall = time.time()
        frame = Frame(wall=wall, events=events, dropped=dropped, engine_state=getattr(eng, "state", "running"))
        if events:
            # When the oldest unread event was published (the subscriber saw it), else its own timestamp.
            frame.event_wall = published if published is not None else wall - (time.perf_counter() - events[0].t)
        if "requests" in needs:
            frame.requests = eng.requests_snapshot()
        if "stats" in needs:
            frame.stats = eng.stats()
        if "snapshot" in needs:
            frame.snapshot = eng.snapshot()
        for p in list(self.panels):
            try:
                p._update(frame)
            except Exception as e:  # one broken panel must not starve the others
                msg = f"{type(p).__name__}: {type(e).__name__}: {e}"
                self.errors = (self.errors + [msg])[-10:]
                log.exception("cbnb panel update failed")
                show = getattr(p, "show", None)
                if show is not None:
                    show(f"display update failed: {type(e).__name__}: {e}", "error")
        self.ticks += 1
        self._last_cost = time.perf_counter() - t0
        self.tick_seconds += self._last_cost
        return frame
