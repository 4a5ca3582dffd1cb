"""The panels' state logic, free of widgets: request rows, streamed text, the KV page map encoding (the plot series
are in `cbnb.ui.series`, re-exported here).

Everything here is plain Python/NumPy so that it can be tested without a browser or a kernel; the widget classes
only move these values into traitlets.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from .series import SKIP_REASONS, StepSeries, TimeSeries  # re-exported: the plot series live in .series

__all__ = [
    "STATE_NAMES", "TERMINAL_STATES", "TextTracker", "request_rows", "stream_items", "StepSeries", "TimeSeries",
    "prompt_label", "request_blocks",
    "encode_kv", "kv_block_details", "SKIP_REASONS", "fmt_bytes",
]

STATE_NAMES = ("PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED", "CANCELLED")
TERMINAL_STATES = frozenset({"FINISHED", "FAILED", "CANCELLED"})


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
        placeholders: the engine's tokens stand for no text (a simulation's): the text says how many there are,
            e.g. "12 tokens (simulated: no text)", instead of repeating a placeholder id ("42 42 42 …").
    """

    def __init__(self, tokenizer: Any, max_chars: int = 4000, placeholders: bool = False) -> None:
        self.tokenizer = tokenizer
        self.placeholders = placeholders
        self.max_chars = max_chars
        self._cache: dict[str, tuple[int, int, str, str]] = {}  # id -> (n tokens, stable n, stable text, text)
        self._labels: dict[str, str] = {}  # id -> the prompt's first words
        self._pieces: dict[int, str] = {}  # token id -> its own text

    def text(self, request_id: str, token_ids: Sequence[int], final_text: str | None = None) -> str:
        """Text of `token_ids` (a request's generated ids so far), cut to `max_chars`."""
        n = len(token_ids)
        hit = self._cache.get(request_id)
        if hit is not None and hit[0] == n and not final_text:
            return hit[3]
        if self.placeholders:
            text = f"{n} token{'' if n == 1 else 's'} (simulated: no text)"
            stable_n, stable_text = 0, ""
        elif final_text:
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

    def label(self, out: Any) -> str:
        """`prompt_label` of a request, decoded once per request."""
        rid = out.request_id
        hit = self._labels.get(rid)
        if hit is None:
            hit = self._labels[rid] = prompt_label(out, self.tokenizer)
        return hit

    def piece(self, token_id: int) -> str:
        """One token's own text (its id when there is no tokenizer); cached per id."""
        t = self._pieces.get(token_id)
        if t is None:
            t = self._pieces[token_id] = (str(token_id) if self.tokenizer is None
                                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
        return t

    def prune(self, keep: Iterable[str]) -> None:
        """Forget requests not in `keep`."""
        keep = set(keep)
        for rid in [r for r in self._cache if r not in keep]:
            del self._cache[rid]
        for rid in [r for r in self._labels if r not in keep]:
            del self._labels[rid]


# ---------------------------------------------------------------------------------------------- requests
def prompt_label(out: Any, tokenizer: Any = None, max_chars: int = 80) -> str:
    """The first words of a request's prompt for display: what was typed (`RequestOutput.prompt_text`), else its ids
    decoded by `tokenizer`, else the first ids ("ids 5 6 7 …")."""
    text = getattr(out, "prompt_text", None)
    ids = list(getattr(out, "prompt_token_ids", None) or [])
    if not text and tokenizer is not None and ids:
        try:
            text = tokenizer.decode(ids[:32], skip_special_tokens=True)
        except Exception:  # a tokenizer that cannot decode these ids: show them
            text = ""
    if not text:
        text = "ids " + " ".join(str(i) for i in ids[:6]) + (" …" if len(ids) > 6 else "")
    text = " ".join(str(text).split())
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"

def _ordered(requests: Sequence[Any], max_finished: int) -> tuple[list[Any], int]:
    """Live requests (arrival order), then ended ones newest first, at most `max_finished` of those."""
    live = [r for r in requests if _state_name(r.state) not in TERMINAL_STATES]
    ended = [r for r in requests if _state_name(r.state) in TERMINAL_STATES]
    ended.reverse()
    hidden = max(0, len(ended) - max_finished)
    return live + ended[:max_finished], hidden


def cap_live(rows: list[list[Any]], max_live: int) -> tuple[list[list[Any]], int]:
    """At most `max_live` live rows of `request_rows`' output (those running first, then the oldest waiting, each
    in arrival order; ended rows kept). Returns (rows, live rows left out)."""
    live = [r for r in rows if r[1] not in TERMINAL_STATES]
    if len(live) <= max_live:
        return rows, 0
    running = [r for r in live if r[1] != "PENDING"]
    waiting = [r for r in live if r[1] == "PENDING"]
    kept = (running + waiting)[:max_live]
    return kept + [r for r in rows if r[1] in TERMINAL_STATES], len(live) - len(kept)


def board_note(counts: dict[str, int], hidden_live: int, hidden_ended: int) -> str:
    """The board's line on what it leaves out, e.g. "showing 200 of 10,000 live requests (9,800 pending not
    listed)" ("" when it lists everything live)."""
    if not hidden_live:
        return ""
    live = sum(n for s, n in counts.items() if s not in TERMINAL_STATES)
    return f"showing {live - hidden_live:,} of {live:,} live requests ({hidden_live:,} not listed: Cancel all reaches them)"


#: The engine's cumulative counters (`stats()["cumulative"]`) of each ended state.
ENDED_COUNTERS = {"FINISHED": "requests_finished", "FAILED": "requests_failed", "CANCELLED": "requests_cancelled"}


def ended_not_kept(counts: dict[str, int], cumulative: dict[str, Any] | None) -> dict[str, int]:
    """Ended requests the engine no longer lists, per state: its cumulative count minus those in its
    `requests_snapshot()` (which keeps the newest 256 ended). Without them the board said "256 finished" after a
    simulated sweep of 13,785 requests (the teacher's trial of issue 40) while the timeline counted 13,785.

    Args:
        counts: per state, over the snapshot (`request_rows`).
        cumulative: `engine.stats()["cumulative"]`, or None (an engine without it: nothing is added).
    """
    if not cumulative:
        return {}
    out = {}
    for state, key in ENDED_COUNTERS.items():
        extra = int(cumulative.get(key) or 0) - counts.get(state, 0)
        if extra > 0:
            out[state] = extra
    return out


#: Columns of the request board, in order (ms = milliseconds).
BOARD_COLUMNS = ("id", "state", "output_tokens", "max_new_tokens", "prompt_tokens", "ttft_ms", "queue_ms",
                 "prefix_cached_tokens", "offloads", "soft_resets", "sampling", "error", "warning", "finish_reason",
                 "prompt_text",
                 "source")


def request_rows(requests: Sequence[Any], max_finished: int = 64,
                 label: Any = None) -> tuple[list[list[Any]], dict[str, int], int]:
    """Rows for the request board.

    Args:
        requests: `engine.requests_snapshot()` (`RequestOutput`s, live first; their `max_new_tokens` gives progress).
        max_finished: ended requests shown at most (newest first).
        label: request output -> the prompt's first words (default: `prompt_label` without a tokenizer).

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
            int(r.num_soft_resets), " · ".join(getattr(r, "processors", ()) or ()), r.error or "",
            getattr(r, "warning", None) or "", r.finish_reason or "", label(r) if label is not None else prompt_label(r),
            getattr(r, "source", None) or "",
        ])
    return rows, counts, hidden


#: Streamed tokens with logprobs shown per request (the newest).
LOGPROB_TOKENS = 32


def _logprob_dicts(lps: Sequence[Any], start: int, texts: TextTracker) -> list[dict[str, Any]]:
    return [{"t": texts.piece(lp.token_id), "i": start + k, "lp": round(lp.logprob, 4),
             "top": [[texts.piece(t), round(v, 4)] for t, v in lp.top]} for k, lp in enumerate(lps)]


def logprob_tokens(r: Any, texts: TextTracker, n: int = LOGPROB_TOKENS) -> list[dict[str, Any]]:
    """The newest `n` tokens of a request that asked for logprobs, for the stream panel's hover: dicts with t (the
    token's text), i (its index among the generated tokens), lp (its logprob, natural log) and top ([text,
    logprob] of the alternatives, most likely first). Empty when the request has no logprobs."""
    lps = getattr(r, "logprobs", None)
    if not lps:
        return []
    start = max(0, len(lps) - n)
    return _logprob_dicts(lps[start:], start, texts)


def prompt_logprob_tokens(r: Any, texts: TextTracker, n: int = LOGPROB_TOKENS) -> list[dict[str, Any]]:
    """The last `n` prompt tokens of a request submitted with ``prompt_logprobs=k``, as `logprob_tokens` gives
    them but with i the token's position in the prompt (from 1: the first token has no logprob). The last ones,
    because that is where a likelihood task puts the continuation it scores. Empty without prompt logprobs."""
    lps = getattr(r, "prompt_logprobs", None)
    if not lps:
        return []
    first = 1 if lps[0] is None else 0  # a RequestOutput's list starts with None for position 0
    start = max(first, len(lps) - n)
    return _logprob_dicts(lps[start:], start + (1 - first), texts)


def stream_items(requests: Sequence[Any], texts: TextTracker, max_finished: int = 12,
                 max_live: int | None = None) -> list[dict[str, Any]]:
    """Items of the token stream: live requests (at most `max_live`: running first) then the newest ended ones,
    each with its text so far.

    Returns:
        dicts with id, state, text, n (tokens out), max (max_new_tokens or None), error, reason (finish reason),
        prompt (the prompt's first words, `prompt_label`),
        lp (`logprob_tokens`: the newest tokens with their logprobs, for requests that asked for them),
        plp (`prompt_logprob_tokens`: the prompt's last tokens with theirs, for requests that asked for them).
    """
    shown, _ = _ordered(requests, max_finished)
    if max_live is not None:
        live = [r for r in shown if _state_name(r.state) not in TERMINAL_STATES]
        if len(live) > max_live:  # running first, then the oldest waiting: a big workload has thousands
            running = [r for r in live if _state_name(r.state) != "PENDING"]
            waiting = [r for r in live if _state_name(r.state) == "PENDING"]
            shown = (running + waiting)[:max_live] + shown[len(live):]
    items = []
    for r in shown:
        state = _state_name(r.state)
        final = r.text if state in TERMINAL_STATES and r.text else None
        items.append({"id": r.request_id, "state": state, "text": texts.text(r.request_id, r.token_ids, final),
                      "n": len(r.token_ids), "max": r.max_new_tokens, "error": r.error or "",
                      "reason": r.finish_reason or "", "prompt": texts.label(r), "lp": logprob_tokens(r, texts),
                      "plp": prompt_logprob_tokens(r, texts)})
    texts.prune(r.request_id for r in requests)
    return items


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
    from ..core.cache.snapshot import BlockState

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
    from ..core.cache.snapshot import BlockState

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


def request_blocks(snapshot: Any, request_id: str) -> dict[str, Any]:
    """Every block a request holds in a `KVSnapshot`, for the page map's highlight.

    Returns:
        {"request_id", "blocks": per group the block indices, "shared": per group the blocks it shares,
        "co_owners": other request id -> blocks shared with it (all groups), "count": blocks in all}; empty lists
        when the request holds no block.
    """
    ids = list(snapshot.request_ids)
    idx = ids.index(request_id) if request_id in ids else -1
    blocks, shared, co = [], [], {}
    for g in snapshot.groups:
        if idx < 0:
            blocks.append([])
            shared.append([])
            continue
        mine = set(np.flatnonzero(g.owner == idx).tolist())
        sh = []
        for b, owners in g.shared_owners.items():
            if idx in owners:
                mine.add(int(b))
                sh.append(int(b))
                for o in owners:
                    if o != idx and 0 <= o < len(ids):
                        co[ids[o]] = co.get(ids[o], 0) + 1
        blocks.append(sorted(int(b) for b in mine))
        shared.append(sorted(sh))
    return {"request_id": request_id, "blocks": blocks, "shared": shared, "co_owners": co,
            "count": sum(len(b) for b in blocks)}
