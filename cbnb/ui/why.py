"""`WhyPanel`: the story of the selected request, "why is it waiting?" (`Engine.explain`, kept live).

Clicking a request anywhere in the dashboard (a board row, a stream card, a timeline row, a KV block) selects it;
this panel then shows its arrival, each step it was left out with the reason, the numbers that decided it and the
config field that would change it, its prompt chunks, prefix hits, offloads and restores, and its end. While the
request lives the story grows with each poll (the panel reads only the new events).
"""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame

__all__ = ["WhyPanel"]


class WhyPanel(Panel):
    """The "Why?" view.

    Synced state: `request_id` ("" for none), `story` (`RequestStory.to_dict()`), `text` (its text form).
    """

    _esm = _assets.esm("why.js")
    request_id = traitlets.Unicode("").tag(sync=True)
    story = traitlets.Dict().tag(sync=True)
    text = traitlets.Unicode("").tag(sync=True)

    def _setup(self) -> None:
        self._builder = None
        self._cursor = 0
        self._live = False

    def explain(self, request_id: str | None) -> None:
        """Show the story of `request_id` (None or "": close the view)."""
        from ..telemetry.explain import StoryBuilder

        with self._lock:
            if not request_id:
                self._builder = None
                with self.hold_sync():
                    self.request_id, self.story, self.text = "", {}, ""
                return
            log = self.engine.events
            events, self._cursor, _ = log.since(0)
            self._builder = StoryBuilder(request_id, getattr(self.engine, "config", None))
            self._builder.feed(events)
            self._publish(request_id, self._now(request_id))
        self.poller.poke()

    def _now(self, request_id: str) -> Any:
        return next((o for o in self.engine.requests_snapshot() if o.request_id == request_id), None)

    def _publish(self, request_id: str, now: Any) -> None:
        b = self._builder
        if b is None:
            return
        if not b.seen and now is None:
            with self.hold_sync():
                self.request_id, self.story = request_id, {"request_id": request_id, "entries": []}
                self.text = (f"No event of {request_id} is in the log (telemetry off, or its events were dropped "
                             "from the log's bound).")
            return
        story = b.story(now)
        self._live = story.state not in ("FINISHED", "FAILED", "CANCELLED")
        d = story.to_dict()
        with self.hold_sync():
            self.request_id = request_id
            if d != self.story:
                self.story = d
                self.text = story.text()

    def on_selection(self, what: str, request_id: str | None) -> None:
        """`Selection` listener: a selected request opens its story."""
        if what == "select":
            self.explain(request_id)

    # ------------------------------------------------------------------------------------------ poller
    def _needs(self) -> set[str]:
        return {"requests"} if self._builder is not None else set()

    def _update(self, frame: Frame) -> None:
        with self._lock:
            b = self._builder
            if b is None:
                return
            events, self._cursor, _ = self.engine.events.since(self._cursor)
            if not events and not self._live:
                return
            b.feed(events)
            # Today's config (after an Apply): the story still quotes each step's own config, and says what changed.
            b.config = getattr(self.engine, "config", None)
            rid = b.rid
            now = next((o for o in frame.requests or () if o.request_id == rid), None)
            self._publish(rid, now)

    def _on_close(self, _msg: dict) -> None:
        self.select_request(None)
        self.explain(None)
