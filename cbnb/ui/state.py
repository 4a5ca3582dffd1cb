"""The panels' state logic, free of widgets: request rows, streamed text, plot series, the KV page map encoding.

Everything here is plain Python/NumPy so that it can be tested without a browser or a kernel; the widget classes
only move these values into traitlets.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..plan import SkipReason

__all__ = [
    "STATE_NAMES", "TERMINAL_STATES", "TextTracker", "request_rows", "stream_items", "StepSeries", "TimeSeries",
    "encode_kv", "kv_block_details", "SKIP_REASONS", "fmt_bytes",
]

STATE_NAMES = ("PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED", "CANCELLED")
TERMINAL_STATES = frozenset({"FINISHED", "FAILED", "CANCELLED"})

#: The scheduler's skip reasons (`cbnb.plan.SkipReason`, plain data), which name the stacked bars.
SKIP_REASONS: tuple[str, ...] = tuple(r.value for r in SkipReason)


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


def fmt_bytes(n: float) -> str:
    """Human-readable bytes, e.g. ``fmt_bytes(3 << 20) == "3.0 MiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# ---------------------------------------------------------------------------------------------- text
class TextTracker:
    """Incremental detokenisation of many requests, for the token stream.

    Only requests whose token count changed are decoded, and only their new tail: the text of the first
    `stable` tokens is kept and never decoded again (it moves forward when the tail decodes without an incomplete
    UTF-8 character). A terminal output's own `text` (decoded once by the engine) replaces the streamed text.

    Args:
        tokenizer: a transformers tokenizer, or None (then the text shows token ids).
        max_chars: keep at most this many trailing characters per request (a leading "…" marks a cut).
    """

    def __init__(self, tokenizer: Any, max_chars: int = 4000) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._cache: dict[str, tuple[int, int, str, str]] = {}  # id -> (n tokens, stable n, stable text, text)

    def text(self, request_id: str, token_ids: Sequence[int], final_text: str | None = None) -> str:
        """Text of `token_ids` (a request's generated ids so far), cut to `max_chars`."""
        n = len(token_ids)
        hit = self._cache.get(request_id)
        if hit is not None and hit[0] == n and not final_text:
            return hit[3]
        if final_text:
            text = final_text
            stable_n, stable_text = n, final_text
        elif self.tokenizer is None:
            text = " ".join(str(i) for i in token_ids[-400:])
            stable_n, stable_text = 0, ""
        else:
            stable_n, stable_text = (hit[1], hit[2]) if hit is not None and hit[1] <= n else (0, "")
            tail = self.tokenizer.decode(list(token_ids[stable_n:]), skip_special_tokens=True)
            if tail.endswith("\ufffd"):  # an incomplete UTF-8 character: show it once it completes
                tail = tail.rstrip("\ufffd")
            elif n - stable_n > 16:
                stable_n, stable_text = n, stable_text + tail
                tail = ""
            text = stable_text + tail
        if len(text) > self.max_chars:
            text = "…" + text[-(self.max_chars - 1):]
        self._cache[request_id] = (n, stable_n, stable_text, text)
        return text

    def prune(self, keep: Iterable[str]) -> None:
        """Forget requests not in `keep`."""
        keep = set(keep)
        for rid in [r for r in self._cache if r not in keep]:
            del self._cache[rid]


# ---------------------------------------------------------------------------------------------- requests
def _ordered(requests: Sequence[Any], max_finished: int) -> tuple[list[Any], int]:
    """Live requests (arrival order), then ended ones newest first, at most `max_finished` of those."""
    live = [r for r in requests if _state_name(r.state) not in TERMINAL_STATES]
    ended = [r for r in requests if _state_name(r.state) in TERMINAL_STATES]
    ended.reverse()
    hidden = max(0, len(ended) - max_finished)
    return live + ended[:max_finished], hidden


#: Columns of the request board, in order (ms = milliseconds).
BOARD_COLUMNS = ("id", "state", "output_tokens", "max_new_tokens", "prompt_tokens", "ttft_ms", "queue_ms",
                 "prefix_cached_tokens", "offloads", "soft_resets", "error", "warning", "finish_reason", "source")


def request_rows(requests: Sequence[Any], max_finished: int = 64) -> tuple[list[list[Any]], dict[str, int], int]:
    """Rows for the request board.

    Args:
        requests: `engine.requests_snapshot()` (`RequestOutput`s, live first; their `max_new_tokens` gives progress).
        max_finished: ended requests shown at most (newest first).

    Returns:
        (rows in `BOARD_COLUMNS` order, count per state over all `requests`, ended requests not shown).
    """
    counts = {s: 0 for s in STATE_NAMES}
    for r in requests:
        counts[_state_name(r.state)] = counts.get(_state_name(r.state), 0) + 1
    shown, hidden = _ordered(requests, max_finished)
    rows = []
    for r in shown:
        tm = r.timings
        ttft = tm.ttft_s
        q = tm.queue_s
        rows.append([
            r.request_id, _state_name(r.state), len(r.token_ids), r.max_new_tokens,
            len(r.prompt_token_ids), None if ttft is None else round(ttft * 1000, 1),
            None if q is None else round(q * 1000, 1), int(r.prefix_cached_tokens), int(r.num_offloads),
            int(r.num_soft_resets), r.error or "", getattr(r, "warning", None) or "", r.finish_reason or "",
            getattr(r, "source", None) or "",
        ])
    return rows, counts, hidden


def stream_items(requests: Sequence[Any], texts: TextTracker, max_finished: int = 12) -> list[dict[str, Any]]:
    """Items of the token stream: live requests then the newest ended ones, each with its text so far.

    Returns:
        dicts with id, state, text, n (tokens out), max (max_new_tokens or None), error, reason (finish reason).
    """
    shown, _ = _ordered(requests, max_finished)
    items = []
    for r in shown:
        state = _state_name(r.state)
        final = r.text if state in TERMINAL_STATES and r.text else None
        items.append({"id": r.request_id, "state": state, "text": texts.text(r.request_id, r.token_ids, final),
                      "n": len(r.token_ids), "max": r.max_new_tokens, "error": r.error or "",
                      "reason": r.finish_reason or ""})
    texts.prune(r.request_id for r in requests)
    return items


# ---------------------------------------------------------------------------------------------- plot series
class _Ring:
    """Fixed-size float32 columns, appended row by row (oldest dropped); `arrays()` gives each column's bytes in
    time order (NaN = missing). Stored column-major so that a column's bytes are one contiguous slice."""

    def __init__(self, columns: Sequence[str], size: int) -> None:
        self.columns = tuple(columns)
        self._index = {c: i for i, c in enumerate(self.columns)}
        self.size = size
        self._data = np.full((len(self.columns), size), np.nan, dtype=np.float32)
        self._n = 0  # rows held
        self._head = 0  # next write position

    def append(self, row: Mapping[str, float | None]) -> None:
        self._data[:, self._head] = [_num(row.get(c)) for c in self.columns]
        self._head = (self._head + 1) % self.size
        self._n = min(self._n + 1, self.size)

    def clear(self) -> None:
        self._data[:] = np.nan
        self._n = self._head = 0

    def __len__(self) -> int:
        return self._n

    def _ordered(self, i: int) -> np.ndarray:
        col = self._data[i]
        if self._n < self.size:
            return col[: self._n]
        return np.concatenate((col[self._head:], col[: self._head]))

    def column(self, name: str) -> np.ndarray:
        return self._ordered(self._index[name]).astype(np.float64)

    def arrays(self) -> dict[str, bytes]:
        return {c: self._ordered(i).tobytes() for i, c in enumerate(self.columns)}


def _num(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


class StepSeries(_Ring):
    """Per-step batch composition from `StepPlanned` events: prefill and decode tokens against the token budget,
    and how many requests were left out for each reason (columns ``skip_<reason>``). A step number that goes back
    (the engine was reconfigured, so its steps count from 1 again) starts the series afresh."""

    def __init__(self, size: int = 240) -> None:
        super().__init__(("step", "prefill", "decode", "budget", "requests")
                         + tuple(f"skip_{r}" for r in SKIP_REASONS), size)
        self._last_step = 0

    def add_events(self, events: Iterable[Any]) -> int:
        """Append a row per `StepPlanned` event. Returns how many were added."""
        n = 0
        for e in events:
            if getattr(e, "kind", "") != "step_planned":
                continue
            if self._n and e.step <= self._last_step:
                self.clear()  # the engine was rebuilt (reconfigure): its step numbers start again
            self._last_step = e.step
            row: dict[str, float] = {"step": e.step, "prefill": e.prefill_tokens, "decode": e.decode_tokens,
                                     "budget": e.token_budget, "requests": e.requests_used}
            for r in SKIP_REASONS:
                row[f"skip_{r}"] = 0.0
            for reason, ids, _detail in e.skipped:
                key = f"skip_{reason}"
                row[key] = row.get(key, 0.0) + len(ids)
            self.append(row)
            n += 1
        return n


class TimeSeries(_Ring):
    """Samples of `engine.stats()` over time (seconds since `t0`): KV usage, prefix hits, offloads, graphs,
    throughput and latency. Throughput is the rate of the cumulative output/prefill token counters between
    samples, averaged over the last `window_s` seconds.

    Time is the engine's own clock when its stats carry one ("clock_s"; a simulator's is simulated seconds, so a
    simulation played faster than real time still shows its own tokens/s), aligned with the wall clock at the first
    sample; else the wall time of the read."""

    COLUMNS = ("t", "kv_blocks_pct", "kv_tokens_pct", "prefix_hit_tokens", "prefix_hit_pct", "swaps",
               "soft_resets", "restores", "graph_captures", "graph_replays", "out_tok_s", "prefill_tok_s",
               "ttft_p50_ms", "tpot_p50_ms")

    def __init__(self, t0: float, size: int = 600, window_s: float = 1.0) -> None:
        super().__init__(self.COLUMNS, size)
        self.t0 = t0
        self.window_s = window_s
        self._counters: deque[tuple[float, float, float]] = deque()
        self._clock0: float | None = None  # engine clock - seconds since t0, fixed at the first sample

    def add_stats(self, wall: float, stats: Mapping[str, Any]) -> dict[str, float | None]:
        """Append one sample from `engine.stats()` read at `wall` (time.time()). Returns the row."""
        run, cum = stats["run"], stats["cumulative"]
        clock = stats.get("clock_s")
        if clock is not None:
            if self._clock0 is None:
                self._clock0 = clock - (wall - self.t0)
            wall = self.t0 + clock - self._clock0
        self._counters.append((wall, float(cum["output_tokens"]), float(cum["prefill_tokens"])))
        while len(self._counters) > 2 and wall - self._counters[1][0] >= self.window_s:
            self._counters.popleft()
        (ta, oa, pa), (tb, ob, pb) = self._counters[0], self._counters[-1]
        dt = tb - ta
        out_rate = (ob - oa) / dt if dt > 0 else 0.0
        pre_rate = (pb - pa) / dt if dt > 0 else 0.0
        ttft, tpot = run["ttft_s"].get("p50"), run["tpot_s"].get("p50")
        row = {
            "t": wall - self.t0,
            "kv_blocks_pct": 100.0 * run["kv_usage_blocks_frac"],
            "kv_tokens_pct": 100.0 * run["kv_usage_tokens_frac"],
            "prefix_hit_tokens": run["prefix_hit_tokens"],
            "prefix_hit_pct": run["prefix_hit_rate_pct"],
            "swaps": run["swaps"], "soft_resets": run["soft_resets"], "restores": run["restores"],
            "graph_captures": run["cuda_graph_captures"], "graph_replays": run["cuda_graph_replays"],
            "out_tok_s": out_rate, "prefill_tok_s": pre_rate,
            "ttft_p50_ms": None if ttft is None else 1000 * ttft,
            "tpot_p50_ms": None if tpot is None else 1000 * tpot,
        }
        self.append(row)
        return row


# ---------------------------------------------------------------------------------------------- KV page map
#: Bits of one page-map cell: the `BlockState` code in bits 0-2, min(refcount, 31) in bits 3-7.
REFCOUNT_SHIFT = 3
REFCOUNT_MAX = 31


def encode_kv(snapshot: Any) -> tuple[list[dict[str, Any]], bytes]:
    """Encode a `KVSnapshot` compactly for the page map: one byte per block.

    Returns:
        (per-group metadata: index, attention_type, page_size, num_layers, num_blocks (reserved ones included),
        usable_blocks, reserved_blocks, offset into the bytes, padding_blocks, counts per state name; the cells of all groups concatenated, uint8, state code in bits
        0-2 and min(refcount, 31) in bits 3-7).
    """
    from ..cache.snapshot import BlockState

    meta = []
    parts = []
    offset = 0
    for g in snapshot.groups:
        rc = np.minimum(np.maximum(g.refcount, 0), REFCOUNT_MAX).astype(np.uint8)
        cells = g.state.astype(np.uint8) | (rc << REFCOUNT_SHIFT)
        parts.append(cells)
        counts = np.bincount(g.state, minlength=len(BlockState.NAMES))
        meta.append({
            "index": int(g.index), "attention_type": str(g.attention_type), "page_size": int(g.page_size),
            "num_layers": int(g.num_layers), "num_blocks": int(g.num_blocks), "offset": offset,
            "usable_blocks": int(g.usable_blocks), "reserved_blocks": int(g.reserved_blocks),
            "padding_blocks": [int(b) for b in g.padding_blocks],
            "counts": {name: int(counts[i]) for i, name in enumerate(BlockState.NAMES)},
            "tokens_filled": int(g.tokens.sum()),
        })
        offset += g.num_blocks
    data = np.concatenate(parts).tobytes() if parts else b""
    return meta, data


def kv_block_details(snapshot: Any, group: int, block: int) -> dict[str, Any]:
    """Hover details of one block: state, refcount, owner request ids, tokens filled.

    Raises:
        ValueError: for a group or block index outside the snapshot.
    """
    from ..cache.snapshot import BlockState

    if not (0 <= group < len(snapshot.groups)):
        raise ValueError(f"group must be in [0, {len(snapshot.groups)}); got {group}")
    g = snapshot.groups[group]
    if not (0 <= block < g.num_blocks):
        raise ValueError(f"block must be in [0, {g.num_blocks}); got {block}")
    state = int(g.state[block])
    owners_idx = g.shared_owners.get(block)
    if owners_idx is None:
        o = int(g.owner[block])
        owners_idx = [o] if o >= 0 else []
    owners = [snapshot.request_ids[i] for i in owners_idx if 0 <= i < len(snapshot.request_ids)]
    return {"group": group, "block": block, "state": BlockState.NAMES[state], "refcount": int(g.refcount[block]),
            "owners": owners, "tokens": int(g.tokens[block]), "page_size": int(g.page_size),
            "attention_type": g.attention_type, "padding": block in g.padding_blocks}
