"""`TokenStreamPanel`: each request's text growing live, under its prompt's first words, with its state and a cancel
button."""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .state import TextTracker, stream_items

__all__ = ["TokenStreamPanel"]


class TokenStreamPanel(Panel):
    """Live text of the engine's requests: live ones first, then the newest ended ones.

    Args:
        engine: the engine.
        max_finished: ended requests kept on screen (newest first).
        max_chars: trailing characters shown per request.
        poller, autostart: see `Panel`.

    Synced state: `items`, a list of dicts {id, state, text, n, max, error, reason, prompt} (see
    `state.stream_items`; `prompt` is the prompt's first words). Finished, failed and cancelled requests are marked by
    their state; a failed one shows its error. A click on a card selects its request (the "Why?" story).
    """

    _esm = _assets.esm("stream.js")
    items = traitlets.List().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)  # the dashboard's selected request ("" for none)

    def __init__(self, engine: Any, *, max_finished: int = 12, max_chars: int = 4000, **kwargs: Any) -> None:
        self._max_finished = max_finished
        self._texts = TextTracker(getattr(engine, "tokenizer", None), max_chars=max_chars)
        super().__init__(engine, **kwargs)

    def _needs(self) -> set[str]:
        return {"requests"}

    def _values(self, frame: Frame) -> dict[str, Any]:
        if frame.requests is None:
            return {}
        return {"items": stream_items(frame.requests, self._texts, self._max_finished)}

    def cancel(self, request_id: str) -> bool:
        """Cancel a request (a CANCELLED output follows). Returns False when it is unknown or already ended."""
        ok = bool(self.engine.cancel(request_id))
        if ok:
            self.show(f"Cancel requested for {request_id}.", "ok")
        else:
            self.show(f"{request_id} has already ended (or is unknown): nothing to cancel.", "info")
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
