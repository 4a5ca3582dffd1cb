"""`RequestBoardPanel`: one row per request with its state, progress, TTFT, prefix-cache hits and offloads."""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .state import BOARD_COLUMNS, request_rows

__all__ = ["RequestBoardPanel"]


class RequestBoardPanel(Panel):
    """A table of every request the engine holds plus the most recently ended ones.

    Args:
        engine: the engine.
        max_finished: ended requests listed at most (newest first; the rest are counted in `hidden`).
        poller, autostart: see `Panel`.

    Synced state:
        columns: `state.BOARD_COLUMNS` (ttft_ms and queue_ms in milliseconds).
        rows: one list per request in that column order (None where unknown).
        counts: requests per state name.
        hidden: ended requests not listed.
        engine_state: "created", "running", "stopped" or "dead".
    """

    _esm = _assets.esm("board.js")
    columns = traitlets.List(traitlets.Unicode(), default_value=list(BOARD_COLUMNS)).tag(sync=True)
    rows = traitlets.List().tag(sync=True)
    counts = traitlets.Dict().tag(sync=True)
    hidden = traitlets.Int(0).tag(sync=True)
    engine_state = traitlets.Unicode("").tag(sync=True)

    def __init__(self, engine: Any, *, max_finished: int = 64, **kwargs: Any) -> None:
        self._max_finished = max_finished
        super().__init__(engine, **kwargs)

    def _needs(self) -> set[str]:
        return {"requests"}

    def _values(self, frame: Frame) -> dict[str, Any]:
        if frame.requests is None:
            return {}
        rows, counts, hidden = request_rows(frame.requests, self._max_finished)
        return {"rows": rows, "counts": counts, "hidden": hidden, "engine_state": frame.engine_state}
