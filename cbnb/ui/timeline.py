"""`TimelinePanel`: what every recent request did in every recent step, on a canvas (the "blocking vs chunked
prefill" picture, live).

Rows are requests (the most recent `max_rows`, arrival order), columns engine steps (the most recent `max_steps`).
A cell is waiting (shaded by the skip reason), a prefill chunk (the whole cell; its tokens are in the hover), a
decode, swapped out / waiting in the host swap pool, a soft reset, or the end (finished, failed,
cancelled). The cells travel as one byte each (`timeline_state`); the front-end asks for a cell's details (step,
tokens, blocks, reason and its numbers) when the pointer rests on it, and a click on a row selects that request
(the "Why?" panel tells its story).
"""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .series import SKIP_REASONS
from .state import prompt_label
from .timeline_state import KINDS, TimelineState

__all__ = ["TimelinePanel"]


class TimelinePanel(Panel):
    """The request timeline.

    Args:
        engine: the engine.
        max_rows: requests shown at most (the oldest drop off; the view scrolls).
        max_steps: steps shown at most (the newest).
        poller, autostart: see `Panel`.

    Synced state:
        rows: per row {id, state, prompt_tokens, max_new_tokens, label (the prompt's first words)}.
        first_step, num_steps: the steps of the columns.
        cells: bytes, rows x num_steps, row-major (`timeline_state` codes).
        kinds, reasons: the names behind the codes; reason_info: reason -> {label, meaning}.
        runs: run markers {step, cause, label} (a new run starts after `step`).
        selected: the selected request id ("" for none).
        note: what the rows leave out ("showing the newest 256 of 10,000 requests ..."; "" when nothing).
        view_steps: how many of the newest steps the columns show (25-500; the cells hold `max_steps`).
    """

    _esm = _assets.esm("timeline.js")
    rows = traitlets.List().tag(sync=True)
    first_step = traitlets.Int(0).tag(sync=True)
    num_steps = traitlets.Int(0).tag(sync=True)
    cells = traitlets.Bytes(b"").tag(sync=True)
    kinds = traitlets.List(traitlets.Unicode(), default_value=list(KINDS)).tag(sync=True)
    reasons = traitlets.List(traitlets.Unicode(), default_value=list(SKIP_REASONS)).tag(sync=True)
    reason_info = traitlets.Dict().tag(sync=True)
    runs = traitlets.List().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)
    view_steps = traitlets.Int(100).tag(sync=True)  # the newest steps the front-end shows (set by its "show" menu)

    def __init__(self, engine: Any, *, max_rows: int = 256, max_steps: int = 500, **kwargs: Any) -> None:
        self.timeline = TimelineState(max_rows, max_steps)
        self._labels: dict[str, str] = {}
        self._sent_version = -1
        super().__init__(engine, **kwargs)

    #: Events of the log read when the panel is made (a dashboard re-made over an engine that already ran shows its
    #: recent steps at once, not "No steps yet").
    seed_events = 20_000

    def _setup(self) -> None:
        from ..telemetry.explain import REASONS

        self.reason_info = {r: {"label": i.label, "meaning": i.meaning} for r, i in REASONS.items()}
        self._seed_last = None
        log = getattr(self.engine, "events", None)
        if log is not None:
            events, _, _ = log.since(max(0, log.cursor - self.seed_events))
            if events:
                self.timeline.add_events(events)
                self._seed_last = events[-1]  # a shared poller made before this panel reads these again: skip them

    def _fresh(self, events: list) -> list:
        """`events` without those the panel already read from the log when it was made."""
        last, self._seed_last = self._seed_last, None
        if last is None or not events:
            self._seed_last = last if not events else None
            return events
        for i in range(len(events) - 1, -1, -1):
            if events[i] is last:
                return events[i + 1:]
        return events

    def _needs(self) -> set[str]:
        return {"requests"}

    def _values(self, frame: Frame) -> dict[str, Any]:
        st = self.timeline
        st.add_events(self._fresh(frame.events))
        if frame.requests is not None:
            tok = getattr(self.engine, "tokenizer", None)
            for r in frame.requests:
                if r.request_id not in self._labels:
                    self._labels[r.request_id] = prompt_label(r, tok)
        if st.version == self._sent_version:
            return {}
        self._sent_version = st.version
        meta, first, n, cells = st.encode()
        keep = {m["id"] for m in meta}
        if len(self._labels) > 2 * st.max_rows:
            self._labels = {k: v for k, v in self._labels.items() if k in keep}
        for m in meta:
            m["label"] = self._labels.get(m["id"], "")
        st.prune_offloads()
        return {"rows": meta, "first_step": first, "num_steps": n, "cells": cells, "runs": list(st.runs),
                "note": st.note()}

    def details(self, request_id: str, step: int) -> dict[str, Any]:
        """Hover details of one cell (see `TimelineState.details`). Raises ValueError outside the window."""
        return self.timeline.details(request_id, step)

    # ------------------------------------------------------------------------------------------ front-end
    def _on_hover(self, msg: dict) -> None:
        reply: dict[str, Any] = {"kind": "hover", "seq": msg.get("seq")}
        try:
            reply.update(self.details(str(msg.get("id", "")), int(msg.get("step", -1))))
        except (ValueError, TypeError) as e:
            reply["error"] = str(e)
        self.send(reply)

    def on_selection(self, what: str, request_id: str | None) -> None:
        """`Selection` listener: outline the selected request's row."""
        if what == "select":
            self.selected = request_id or ""

