"""`TokenStreamPanel`: each request's text growing live, under its prompt's first words, with its state and a cancel
button."""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import RequestPanel
from .poller import Frame
from .state import TextTracker, stream_items

__all__ = ["TokenStreamPanel"]


class TokenStreamPanel(RequestPanel):
    """Live text of the engine's requests: live ones first, then the newest ended ones.

    Args:
        engine: the engine.
        max_finished: ended requests kept on screen (newest first).
        max_live: live requests shown at most (running first, then the oldest waiting; the board counts them all).
        max_chars: trailing characters shown per request.
        poller, autostart: see `Panel`.

    Synced state: `items`, a list of dicts {id, state, text, n, max, error, reason, prompt} (see
    `state.stream_items`; `prompt` is the prompt's first words). Finished, failed and cancelled requests are marked by
    their state; a failed one shows its error. A click on a card selects its request (the "Why?" story).
    """

    _esm = _assets.esm("stream.js")
    items = traitlets.List().tag(sync=True)

    def __init__(self, engine: Any, *, max_finished: int = 12, max_live: int = 48, max_chars: int = 4000,
                 **kwargs: Any) -> None:
        self._max_finished, self._max_live = max_finished, max_live
        self._texts = TextTracker(getattr(engine, "tokenizer", None), max_chars=max_chars,
                                  placeholders=bool(getattr(engine, "placeholder_tokens", False)))
        super().__init__(engine, **kwargs)

    def _needs(self) -> set[str]:
        return {"requests"}

    def _values(self, frame: Frame) -> dict[str, Any]:
        if frame.requests is None:
            return {}
        return {"items": stream_items(frame.requests, self._texts, self._max_finished, self._max_live)}
