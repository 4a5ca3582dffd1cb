"""`RequestBoardPanel`: one row per request with its prompt's first words, state, progress, TTFT, prefix-cache hits and
offloads; a Cancel button per live row and "Cancel all"; a click on a row selects the request (its "Why?" story)."""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import RequestPanel
from .poller import Frame
from .state import BOARD_COLUMNS, board_note, cap_live, ended_not_kept, prompt_label, request_rows

__all__ = ["RequestBoardPanel"]


class RequestBoardPanel(RequestPanel):
    """A table of every request the engine holds plus the most recently ended ones.

    Args:
        engine: the engine.
        max_finished: ended requests listed at most (newest first; the rest are counted in `hidden`).
        max_live: live requests listed at most (running first, then the oldest waiting; `note` says how many are
            left out).
        poller, autostart: see `Panel`.

    Synced state:
        columns: `state.BOARD_COLUMNS` (ttft_ms and queue_ms in milliseconds).
        rows: one list per request in that column order (None where unknown); "prompt_text" is the prompt's first
            words (`state.prompt_label`).
        counts: requests per state name.
        hidden: ended requests not listed.
        note: what else is left out ("showing 200 of 10,000 live requests ..."; "" when nothing).
        engine_state: "created", "running", "paused" (step mode holds it between steps), "stopped" or "dead".
    """

    _esm = _assets.esm("board.js")
    columns = traitlets.List(traitlets.Unicode(), default_value=list(BOARD_COLUMNS)).tag(sync=True)
    rows = traitlets.List().tag(sync=True)
    counts = traitlets.Dict().tag(sync=True)
    hidden = traitlets.Int(0).tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)
    engine_state = traitlets.Unicode("").tag(sync=True)

    def __init__(self, engine: Any, *, max_finished: int = 64, max_live: int = 200, **kwargs: Any) -> None:
        self._max_finished, self._max_live = max_finished, max_live
        self._labels: dict[str, str] = {}
        super().__init__(engine, **kwargs)

    def _needs(self) -> set[str]:
        return {"requests", "stats"}

    def _label(self, out: Any) -> str:
        hit = self._labels.get(out.request_id)
        if hit is None:
            hit = self._labels[out.request_id] = prompt_label(out, getattr(self.engine, "tokenizer", None))
        return hit

    def _values(self, frame: Frame) -> dict[str, Any]:
        if frame.requests is None:
            return {}
        rows, counts, hidden = request_rows(frame.requests, self._max_finished, label=self._label)
        # The engine lists only its newest ended requests: count the older ones too (from its cumulative counters).
        for state, n in ended_not_kept(counts, (frame.stats or {}).get("cumulative")).items():
            counts[state] += n
            hidden += n
        rows, hidden_live = cap_live(rows, self._max_live)
        if len(self._labels) > 4 * (len(rows) + 64):
            keep = {r[0] for r in rows}
            self._labels = {k: v for k, v in self._labels.items() if k in keep}
        state = frame.engine_state
        if state == "running" and getattr(self.engine, "paused", False):
            state = "paused"  # alive but held by the step mode: "running" would contradict the Controls bar
        return {"rows": rows, "counts": counts, "hidden": hidden, "engine_state": state,
                "note": board_note(counts, hidden_live, hidden)}

    # ------------------------------------------------------------------------------------------ actions
    def cancel_all(self) -> int:
        """Cancel every unfinished request (`engine.cancel_all`). Returns how many."""
        n = int(self.engine.cancel_all())
        self.show(f"Cancelled {n} unfinished request{'s' if n != 1 else ''}: their blocks are freed." if n else
                  "No unfinished request to cancel.", "ok" if n else "info")
        self.poller.poke()
        return n

    def _on_cancel_all(self, _msg: dict) -> None:
        self.cancel_all()

