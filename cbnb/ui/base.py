"""`Panel`: the anywidget base class shared by every dashboard panel.

A panel is an `anywidget.AnyWidget` with an ES module from `widgets/`, a message line (`message`, `message_kind`)
for errors and confirmations, and two timestamps that travel with every data update:

- `_stamp`: `time.time()` when the poller read the engine for this update;
- `_event_t`: wall-clock time of the oldest engine event behind it (0 when none).

The front-end records ``Date.now()/1000 - _stamp`` (and the same for `_event_t`) in
``globalThis.__cbnbLatency``, which the browser tests read to measure update latency.

A panel built alone gets its own `Poller`; `Dashboard` builds its panels with one shared poller instead.

Liveness: the poller also sets `_beat` (`time.time()`) every `Poller.beat_s` seconds from its own thread; a panel
that stops hearing it says that its kernel is gone (`widgets/_common.js`). Its incoming messages (clicks) are
handled on cbnb's kernel subshell (`cbnb.ui.live`), so they act while a cell runs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import anywidget
import traitlets

from . import _assets
from .live import route_comm
from .poller import Frame, Poller

__all__ = ["Panel", "RequestPanel"]

log = logging.getLogger(__name__)


class Panel(anywidget.AnyWidget):
    """Base class of the dashboard panels.

    Args:
        engine: the `cbnb.Engine` to show.
        poller: a shared `Poller` (the Dashboard's); None: the panel makes and starts its own.
        autostart: with `poller=None`, start the panel's own poller now (False: call `panel.poller.start()`).
    """

    _css = _assets.css()
    message = traitlets.Unicode("").tag(sync=True)
    message_kind = traitlets.Unicode("info").tag(sync=True)  # "info" | "ok" | "error"
    _stamp = traitlets.Float(0.0).tag(sync=True)
    _event_t = traitlets.Float(0.0).tag(sync=True)
    _beat = traitlets.Float(0.0).tag(sync=True)

    def __init__(self, engine: Any, *, poller: Poller | None = None, autostart: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        # Serialises Python-side writers: the poller thread, the kernel's main thread and its UI subshell.
        self._lock = threading.RLock()
        self.on_msg(self._dispatch)
        self.routed = route_comm(self)  # True: its clicks are handled while a cell runs
        self._setup()
        self._owns_poller = poller is None
        if poller is None:
            poller = Poller(engine, [self])
            if autostart:
                poller.start()
        else:
            poller.add(self)
        self.poller = poller

    def _setup(self) -> None:
        """Subclass hook: initialise state before the poller may call `_update`."""

    # ------------------------------------------------------------------------------------------ selection
    #: The dashboard's shared `Selection` (None for a panel used alone); set by `Dashboard`.
    selection = None
    #: Whether the engine is still the notebook's (`binding.EngineBinding`); the panel's own until `Dashboard` sets
    #: the shared one.
    binding = None

    def engine_note(self) -> str:
        """"" while the engine is alive and still the notebook's; else what happened (`EngineBinding.note`)."""
        if self.binding is None:
            from .binding import EngineBinding

            self.binding = EngineBinding(self.engine)
        return self.binding.note()

    def select_request(self, request_id: str | None) -> None:
        """Select a request for the dashboard's other panels ("Why?", KV highlight); no-op without a selection."""
        if self.selection is not None:
            self.selection.select(request_id)

    def hover_request(self, request_id: str | None) -> None:
        """Report the request under the pointer (None: none); no-op without a selection."""
        if self.selection is not None:
            self.selection.hover(request_id)

    def _on_select(self, msg: dict) -> None:
        rid = msg.get("id")
        self.select_request(rid if isinstance(rid, str) and rid else None)

    def _on_hover_request(self, msg: dict) -> None:
        rid = msg.get("id")
        self.hover_request(rid if isinstance(rid, str) and rid else None)

    # ------------------------------------------------------------------------------------------ messages
    def show(self, text: str, kind: str = "info") -> None:
        """Show `text` on the panel's message line; `kind` is "info", "ok" or "error"."""
        if kind not in ("info", "ok", "error"):
            kind = "info"
        with self.hold_sync():
            self.message_kind = kind
            self.message = str(text)

    def _dispatch(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """Route a front-end message ``{"kind": k, ...}`` to ``self._on_<k>(content)``; errors go to the panel."""
        if not isinstance(content, dict):
            return
        kind = str(content.get("kind", ""))
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            self.show(f"unknown action {kind!r}", "error")
            return
        try:
            handler(content)
        except Exception as e:  # shown in the panel, never raised into the comm handler
            log.exception("cbnb panel action %s failed", kind)
            self.show(f"{kind} failed: {type(e).__name__}: {e}", "error")

    # ------------------------------------------------------------------------------------------ updates
    def _needs(self) -> set[str]:
        """What this panel needs in a frame: a subset of {"requests", "stats", "snapshot"}."""
        return set()

    def _update(self, frame: Frame) -> None:
        """Refresh the synced state from `frame` (poller thread). Override `_values`; this sets what changed."""
        values = self._values(frame)
        if not values:
            return
        with self._lock:
            changed = {k: v for k, v in values.items() if _differs(getattr(self, k), v)}
            if not changed:
                return
            with self.hold_sync():
                for k, v in changed.items():
                    setattr(self, k, v)
                self._event_t = frame.event_wall or 0.0
                self._stamp = frame.wall
        # Python's share of the update latency: engine read -> message handed to the kernel's IOPub thread.
        self.poller.send_lag.append(time.time() - frame.wall)

    def _values(self, frame: Frame) -> dict[str, Any]:
        """Trait name -> new value for this frame (only those that differ are sent)."""
        return {}

    def _heartbeat(self, now: float) -> None:
        """Tell the front-end the kernel is alive (poller thread)."""
        with self._lock:
            self._beat = now

    def close(self) -> None:
        """Stop the panel's own poller (if it has one) and close the widget."""
        # getattr: ipywidgets' __del__ also closes a panel whose __init__ raised half way.
        if getattr(self, "_owns_poller", False) and getattr(self, "poller", None) is not None:
            self.poller.stop()
        super().close()


def _differs(old: Any, new: Any) -> bool:
    try:
        return bool(old != new)
    except Exception:  # e.g. numpy arrays: compare by identity
        return old is not new


class RequestPanel(Panel):
    """A panel listing requests (the board, the token stream): each can be cancelled from the page, and the
    dashboard's selected request is marked (`selected`, "" for none)."""

    selected = traitlets.Unicode("").tag(sync=True)

    def cancel(self, request_id: str) -> bool:
        """Cancel one request (as `engine.cancel`; a CANCELLED output follows); the result is shown on the panel.
        Returns False when the request is unknown or has already ended."""
        ok = bool(self.engine.cancel(request_id))
        self.show(f"Cancel requested for {request_id}." if ok else
                  f"{request_id} has already ended (or is unknown): nothing to cancel.", "ok" if ok else "info")
        self.poller.poke()
        return ok

    def _on_cancel(self, msg: dict) -> None:
        rid = msg.get("id")
        if not isinstance(rid, str) or not rid:
            self.show("cancel: no request id given", "error")
            return
        self.cancel(rid)

    def on_selection(self, what: str, request_id: str | None) -> None:
        """`Selection` listener: mark the selected request."""
        if what == "select":
            self.selected = request_id or ""
