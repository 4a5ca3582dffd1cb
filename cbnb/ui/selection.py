"""`Selection`: the request a dashboard's panels point at, shared by them (Python side).

Clicking a request (a board row, a stream card, a timeline row, a KV block) *selects* it: the "Why?" panel tells
its story and the KV page map highlights its blocks. Resting the pointer on one *hovers* it (the page map
highlights its blocks until the pointer leaves). Panels report both through `Panel.select_request` /
`Panel.hover_request`; listeners are called on the thread that reported it (the kernel's), so they must be cheap.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["Selection"]

log = logging.getLogger(__name__)

Listener = Callable[[str, "str | None"], None]  # (what: "select" | "hover", request id or None)


class Selection:
    """The selected and the hovered request (ids, or None)."""

    def __init__(self) -> None:
        self.selected: str | None = None
        self.hovered: str | None = None
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(what, request_id)`` on every change. Returns the function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def select(self, request_id: str | None) -> None:
        """Select a request (None: clear the selection)."""
        self.selected = request_id or None
        self._notify("select", self.selected)

    def hover(self, request_id: str | None) -> None:
        """The pointer rests on a request (None: it left)."""
        if (request_id or None) == self.hovered:
            return
        self.hovered = request_id or None
        self._notify("hover", self.hovered)

    def _notify(self, what: str, rid: str | None) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for cb in listeners:
            try:
                cb(what, rid)
            except Exception:  # one broken listener must not break the others
                log.exception("cbnb selection listener failed")
