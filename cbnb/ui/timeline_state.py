"""The request timeline's state, free of widgets: what every recent request did in every recent step.

One row per request (the most recent `max_rows`, in arrival order), one column per engine step (the most recent
`max_steps`). Each cell is one byte: the kind in bits 0-3 (`KINDS`) and a value in bits 4-7:

- WAITING, IN_SWAP: the skip reason's index in `SKIP_REASONS` (15: no reason recorded);
- PREFILL: the chunk's query tokens as a share of the step's token budget, in 1..15 (15 = the whole budget);
- others: 0.

Built incrementally from the event log (`add_events`): `StepPlanned` gives who ran (prefill chunk or decode) and
who was left out (and why), `Offload`/`Restore` the swaps and soft resets, `RequestDone` the end, block events the
blocks each request holds. Hover details (`details`) come from the last `max_steps` `StepPlanned` events kept here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Iterable

import numpy as np

from .series import SKIP_REASONS

__all__ = ["KINDS", "TimelineState"]

#: Cell kinds (bits 0-3 of a cell).
KINDS = ("empty", "waiting", "prefill", "decode", "in_swap", "swapped_out", "soft_reset", "finished", "failed",
         "cancelled")
EMPTY, WAITING, PREFILL, DECODE, IN_SWAP, SWAPPED_OUT, SOFT_RESET, FINISHED, FAILED, CANCELLED = range(len(KINDS))
_REASON_INDEX = {r: i for i, r in enumerate(SKIP_REASONS)}
_END_KIND = {"FINISHED": FINISHED, "FAILED": FAILED, "CANCELLED": CANCELLED}


class TimelineState:
    """Cells of the request timeline (see the module docstring).

    Args:
        max_rows: requests kept (the oldest dropped first).
        max_steps: steps kept (the window).
    """

    def __init__(self, max_rows: int = 256, max_steps: int = 500) -> None:
        if max_rows < 1 or max_steps < 1:
            raise ValueError(f"max_rows and max_steps must be >= 1; got {max_rows}, {max_steps}")
        self.max_rows, self.max_steps = max_rows, max_steps
        self.cells = np.zeros((max_rows, max_steps), dtype=np.uint8)
        self.blocks = np.zeros((max_rows, max_steps), dtype=np.uint16)
        self.col_step = np.full(max_steps, -1, dtype=np.int64)  # the step each column holds now
        self.rows: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> {slot, state, prompt_tokens, ...}
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self.last_step = 0
        self.first_step: int | None = None  # the oldest step seen (columns before it are empty)
        self._held: dict[str, int] = {}  # request id -> blocks held now (all layer groups)
        self._swapped: set[str] = set()
        self._plans: deque[Any] = deque(maxlen=max_steps)  # StepPlanned events of the window (hover details)
        self._offloads: dict[int, list[Any]] = {}  # step -> Offload / Restore events (hover details)
        self.runs: list[dict[str, Any]] = []  # {step, cause, label} of RunStarted events
        self._seen: set[str] = set()  # every request id met (bounded by `SEEN_MAX`), for "showing N of M"
        self._seen_over = 0  # requests met after `_seen` filled up
        self.version = 0  # bumped whenever the cells change

    #: Request ids remembered for the count of requests met; past it, new requests are only counted.
    SEEN_MAX = 200_000

    def clear(self) -> None:
        """Forget everything (the version keeps counting)."""
        version = self.version
        self.__init__(self.max_rows, self.max_steps)
        self.version = version + 1

    # ------------------------------------------------------------------------------------------ rows, columns
    def _meet(self, rid: str) -> None:
        if rid in self._seen:
            return
        if len(self._seen) < self.SEEN_MAX:
            self._seen.add(rid)
        else:
            self._seen_over += 1

    @property
    def total_requests(self) -> int:
        """Requests met in the events read (those given a row and those left off)."""
        return len(self._seen) + self._seen_over

    def note(self) -> str:
        """What the rows leave out, e.g. "showing the newest 256 of 10,000 requests" ("" when every request met
        has a row)."""
        total, shown = self.total_requests, len(self.rows)
        if total <= shown:
            return ""
        return f"showing the newest {shown:,} of {total:,} requests (the timeline keeps {self.max_rows:,} rows)"

    def _row(self, rid: str, create: bool = False) -> int | None:
        r = self.rows.get(rid)
        if r is not None:
            return r["slot"]
        if not create:
            return None
        self._meet(rid)
        if not self._free_slots:  # drop the oldest request
            _, old = self.rows.popitem(last=False)
            self._free_slots.append(old["slot"])
        slot = self._free_slots.pop()
        self.cells[slot] = EMPTY
        self.blocks[slot] = 0
        self.rows[rid] = {"slot": slot, "state": "PENDING", "prompt_tokens": None, "max_new_tokens": None}
        return slot

    def _col(self, step: int) -> int | None:
        """The column of `step` (None when it left the window or was never reached)."""
        c = step % self.max_steps
        return c if self.col_step[c] == step else None

    def _new_step(self, step: int) -> int:
        c = step % self.max_steps
        if self.col_step[c] != step:
            self.cells[:, c] = EMPTY
            self.blocks[:, c] = 0
            self.col_step[c] = step
        if self.first_step is None:
            self.first_step = step
        self.last_step = max(self.last_step, step)
        return c

    def _set(self, rid: str, step: int, code: int) -> None:
        slot = self._row(rid)
        c = self._col(step)
        if slot is None or c is None:
            return
        self.cells[slot, c] = code
        self.blocks[slot, c] = min(self._held.get(rid, 0), 65535)

    def _slots(self, items: Iterable[Any], key: Any = None) -> tuple[list[Any], list[int]]:
        """The `items` (request ids, or tuples whose `key` gives the id) that have a row, and their row slots, in
        step. A request never seen gets a row while there is room (one admitted before the timeline existed), but
        never pushes a newer request out: the rest are left off (and counted in `total_requests`)."""
        rows, kept, out = self.rows, [], []
        for item in items:
            rid = item if key is None else key(item)
            r = rows.get(rid)
            if r is None:
                if len(rows) >= self.max_rows:
                    self._meet(rid)
                    continue
                self._row(rid, create=True)
                r = rows[rid]
            kept.append(item)
            out.append(r["slot"])
        return kept, out

    # ------------------------------------------------------------------------------------------ events
    def add_events(self, events: Iterable[Any]) -> int:
        """Fold events (oldest first) into the cells. Returns how many changed something."""
        n = 0
        for e in events:
            h = getattr(self, f"_on_{getattr(e, 'kind', '')}", None)
            if h is not None:
                h(e)
                n += 1
        if n:
            self.version += 1
        return n

    def _on_request_added(self, e: Any) -> None:
        self._row(e.request_id, create=True)
        self.rows[e.request_id].update(prompt_tokens=e.prompt_tokens, max_new_tokens=e.max_new_tokens)

    def _on_step_planned(self, e: Any) -> None:
        if e.step < self.last_step:
            self.clear()  # steps counted from 1 again: another engine
        c = self._new_step(e.step)
        self._plans.append(e)
        budget = max(1, int(e.token_budget))
        held = self._held
        taken, slots = self._slots(e.taken, key=lambda t: t[0])
        if taken:
            codes = [PREFILL | (max(1, min(15, round(15 * n / budget))) << 4) if phase == "prefill" else DECODE
                     for _rid, phase, n, _s, _h in taken]
            self.cells[slots, c] = codes
            self.blocks[slots, c] = [min(held.get(t[0], 0), 65535) for t in taken]
            for rid, phase, *_ in taken:
                self._swapped.discard(rid)
                self.rows[rid]["state"] = "PREFILLING" if phase == "prefill" else "DECODING"
        for reason, ids, _detail in e.skipped:
            idx = _REASON_INDEX.get(reason, 15) << 4
            kept, slots = self._slots(ids)
            if not kept:
                continue
            swapped = self._swapped
            self.cells[slots, c] = [(IN_SWAP if rid in swapped else WAITING) | idx for rid in kept]
            self.blocks[slots, c] = [min(held.get(rid, 0), 65535) for rid in kept]

    def _on_offload(self, e: Any) -> None:
        self._offloads.setdefault(e.step, []).append(e)
        self._held[e.request_id] = 0
        if e.path == "swap":
            self._swapped.add(e.request_id)
        self._set(e.request_id, e.step, SWAPPED_OUT if e.path == "swap" else SOFT_RESET)
        if e.request_id in self.rows:
            self.rows[e.request_id]["state"] = "PENDING"

    def _on_restore(self, e: Any) -> None:
        self._offloads.setdefault(e.step, []).append(e)
        self._swapped.discard(e.request_id)

    def _on_request_done(self, e: Any) -> None:
        self._held.pop(e.request_id, None)
        self._swapped.discard(e.request_id)
        if e.request_id in self.rows:
            self.rows[e.request_id]["state"] = e.state
        slot = self._row(e.request_id)
        c = self._col(e.step)
        if slot is not None and c is not None:
            self.cells[slot, c] = _END_KIND.get(e.state, FINISHED)
            self.blocks[slot, c] = 0

    def _on_blocks_allocated(self, e: Any) -> None:
        self._held[e.request_id] = self._held.get(e.request_id, 0) + sum(len(b) for b in e.blocks)
        self._touch(e.request_id, e.step)

    def _on_blocks_shared(self, e: Any) -> None:
        self._held[e.request_id] = self._held.get(e.request_id, 0) + len(e.blocks)
        self._touch(e.request_id, e.step)

    def _on_blocks_freed(self, e: Any) -> None:
        self._held[e.request_id] = 0

    def _on_run_started(self, e: Any) -> None:
        self.runs = (self.runs + [{"step": int(e.step), "cause": e.cause, "label": e.label}])[-16:]

    def _touch(self, rid: str, step: int) -> None:
        slot, c = self._row(rid), self._col(step)
        if slot is not None and c is not None:
            self.blocks[slot, c] = min(self._held.get(rid, 0), 65535)

    # ------------------------------------------------------------------------------------------ output
    def window(self) -> tuple[int, int]:
        """(first step shown, number of columns): the newest `max_steps` steps, from the first step seen."""
        if self.first_step is None:
            return 0, 0
        first = max(self.first_step, self.last_step - self.max_steps + 1)
        return first, self.last_step - first + 1

    def encode(self) -> tuple[list[dict[str, Any]], int, int, bytes]:
        """The cells to draw: (rows in arrival order: {id, state, prompt_tokens, max_new_tokens}, first step,
        columns, bytes of rows x columns uint8, row-major, column 0 = the first step)."""
        first, ncols = self.window()
        meta = [{"id": rid, **{k: v for k, v in r.items() if k != "slot"}} for rid, r in self.rows.items()]
        if not ncols or not meta:
            return meta, first, ncols, b""
        slots = np.fromiter((r["slot"] for r in self.rows.values()), dtype=np.intp, count=len(self.rows))
        cols = np.arange(first, first + ncols) % self.max_steps
        grid = self.cells[np.ix_(slots, cols)]
        stale = self.col_step[cols] != np.arange(first, first + ncols)
        if stale.any():
            grid[:, stale] = EMPTY
        return meta, first, ncols, grid.tobytes()

    def details(self, request_id: str, step: int) -> dict[str, Any]:
        """What `request_id` did in `step`: "cell" (its kind), tokens and positions, the skip reason and its numbers,
        blocks held.

        Raises:
            ValueError: the request or the step is not in the window.
        """
        from ..telemetry.explain import REASONS, reason_numbers

        slot, c = self._row(request_id), self._col(int(step))
        if slot is None:
            raise ValueError(f"request {request_id!r} is not on the timeline")
        if c is None:
            raise ValueError(f"step {step} is not in the timeline's window")
        code = int(self.cells[slot, c])
        out: dict[str, Any] = {"request_id": request_id, "step": int(step), "cell": KINDS[code & 15],
                               "blocks": int(self.blocks[slot, c])}
        plan = next((p for p in reversed(self._plans) if p.step == step), None)
        if plan is not None:
            out["token_budget"] = plan.token_budget
            for rid, phase, n, start, hit in plan.taken:
                if rid == request_id:
                    out.update(phase=phase, tokens=n, start=start, prefix_hit_tokens=hit)
            for reason, ids, detail in plan.skipped:
                if request_id in ids:
                    info = REASONS.get(reason)
                    out.update(reason=reason, reason_label=info.label if info else reason,
                               meaning=info.meaning if info else "", fields=list(info.fields) if info else [],
                               numbers=reason_numbers(reason, detail))
        for o in self._offloads.get(int(step), []):
            if o.request_id == request_id:
                if o.kind == "offload":
                    out.update(offload=o.path, offload_reason=o.reason, tokens_to_recompute=o.tokens_to_recompute)
                else:
                    out["restored_blocks"] = o.blocks
        return out

    def prune_offloads(self) -> None:
        """Forget offload records older than the window."""
        first, _ = self.window()
        for s in [s for s in self._offloads if s < first]:
            del self._offloads[s]
