"""The CUDA runner's host-side step packing: a step's rows into the IO pair's pinned int32 metadata buffer.

`step_shape` sizes the step (tokens, requests, longest KV, decode rows, prefill tiles) and asks the `ShapePlanner` for
its (possibly padded) `StepShape`; a `RowPacker` then packs the rows in step order, `decode_row` for a one-token row
and `chunk_row` for a prefill chunk, from the plan's own KV data (`cbnb.core.plan.StepKV`: block tables and write
slots; the cache manager is never read), and `write` copies the packed lists into the buffer
(`cbnb.runner.cuda.graphs.MetaLayout`: token ids, positions, carry-over indices, logits rows, per-request query
start / length / past, the decode list and the prefill tile list, and per layer group the write slots and block
tables).

Carry-over (async batching): a row whose last token is the placeholder -1 (its sample of the previous step is not
applied yet) gets token 0 and the previous step's output row to read it from on the device (`carry`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.plan import StepKV
from .graphs import MetaLayout, ShapePlanner, StepShape, cdiv

__all__ = ["step_shape", "RowPacker"]


def step_shape(entries: list[Any], planner: ShapePlanner, block_m: int, graph_decode: bool,
               graph_varlen: bool) -> StepShape:
    """The step's shape for `entries` (the plan's `ScheduledRequest`s): padded to a graph's bucket when the step
    kind (pure decode, or varlen) runs as a graph; `block_m` is the prefill kernel's query tile (rows per tile)."""
    num_tokens = max_kv = n_dec = n_tiles = 0
    for s in entries:
        n = s.num_tokens
        num_tokens += n
        end = s.start + n
        if end > max_kv:
            max_kv = end
        if n == 1:
            n_dec += 1
        else:
            n_tiles += cdiv(n, block_m)
    decode_only = n_dec == len(entries)
    return planner.plan(num_tokens=num_tokens, num_seqs=len(entries), max_kv=max_kv, decode_only=decode_only,
                        pad=graph_decode if decode_only else graph_varlen, num_tiles=n_tiles, num_dec=n_dec)


class RowPacker:
    """Packs one step's rows (call `decode_row` / `chunk_row` per row in step order, then `write`).

    Args:
        shape, lay, buf: the step's shape, its `MetaLayout` and the IO pair's host buffer (numpy int32, its defaults
            filled); the block tables are written into `buf` row by row, the rest by `write`.
        kv: the step's `StepKV`.
        windows: per layer group, the sliding window in tokens (0: full attention).
        block_m: the prefill kernel's query tile.
        prev_rows: request id -> its sample's row in the previous step's output (carry-over).
        count_kv: count the KV tokens each group reads (`kv_tokens`, for the step profile).
    """

    __slots__ = ("lay", "buf", "page", "kv_rows", "ng", "tables", "widths", "windows", "block_m", "prev", "count_kv",
                 "ids", "pos", "q_start", "q_len", "past", "dec", "tseq", "tm0", "lidx", "carry_at", "carry_row",
                 "slots", "kv_tokens", "rows", "a")

    def __init__(self, shape: StepShape, lay: MetaLayout, buf: np.ndarray, kv: StepKV, windows: list[int],
                 block_m: int, prev_rows: dict[str, int], count_kv: bool) -> None:
        self.lay, self.buf, self.page = lay, buf, kv.page_size
        self.kv_rows = kv.rows
        ng = len(kv.groups)
        self.ng = ng
        self.tables = [lay.view(buf, f"table{g}") for g in range(ng)]
        self.widths = shape.widths
        self.windows = windows
        self.block_m = block_m
        self.prev = prev_rows
        self.count_kv = count_kv
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.q_start: list[int] = []
        self.q_len: list[int] = []
        self.past: list[int] = []
        self.dec: list[int] = []
        self.tseq: list[int] = []
        self.tm0: list[int] = []
        self.lidx: list[int] = []
        self.carry_at: list[int] = []
        self.carry_row: list[int] = []
        self.slots: list[list[int]] = [[] for _ in range(ng)]
        self.kv_tokens = [0] * ng
        self.rows: dict[str, int] = {}  # request id -> its row among the step's sampled rows
        self.a = 0  # tokens packed so far

    def _carried(self, rid: str, at: int, position: int, ok: bool = True) -> None:
        """Token `at` of the step reads the request's sample of the previous step (`ok`: the rest is known)."""
        row = self.prev.get(rid)
        if row is None or not ok:
            raise RuntimeError(f"request {rid!r}: unknown token at position {position} and no sample of the previous "
                               "step to carry over")
        self.carry_at.append(at)
        self.carry_row.append(row)

    def decode_row(self, i: int, s: Any) -> None:
        """Row `i`, a one-token row: its token (the same values as `Request.token_ids`, inlined), its write slot
        from its block table (`cbnb.core.plan.decode_slot`, inlined) and its tables."""
        req = s.request
        rid = req.request_id
        st = s.start
        npr = len(req.prompt_ids)
        if st < npr:
            tok = req.prompt_ids[st]
        elif st < npr + len(req.output_ids):
            tok = req.output_ids[st - npr]
        else:
            tok = -1
        if tok < 0:
            self._carried(rid, self.a, st)
            tok = 0
        self.ids.append(tok)
        self.pos.append(st)
        self.dec.append(i)
        row_tables = self.kv_rows[rid].tables
        P, windows, widths, slots, tables = self.page, self.windows, self.widths, self.slots, self.tables
        for g in range(self.ng):
            t = row_tables[g]
            win = windows[g]
            r = st % win if win else st
            slots[g].append(t[r // P] * P + r % P)
            w = widths[g]
            tables[g][i, :len(t)] = t if len(t) <= w else t[:w]
            if self.count_kv:
                self.kv_tokens[g] += min(st + 1, win) if win else st + 1
        a = self.a
        self.q_start.append(a)
        self.q_len.append(1)
        self.past.append(st)
        if s.samples:
            self.rows[rid] = len(self.lidx)
            self.lidx.append(a)
        self.a = a + 1

    def chunk_row(self, i: int, s: Any) -> None:
        """Row `i`, a prefill chunk: its tokens and positions, its prefill tiles, its write slots and tables."""
        req = s.request
        rid = req.request_id
        n, st = s.num_tokens, s.start
        toks = req.token_ids(st, st + n)
        if toks[-1] < 0:  # only the chunk's last token may be carried over
            self._carried(rid, self.a + n - 1, st + n - 1, ok=min(toks[:-1]) >= 0)
            toks[-1] = 0
        self.ids.extend(toks)
        self.pos.extend(range(st, st + n))
        m0s = range(0, n, self.block_m)
        self.tseq.extend([i] * len(m0s))
        self.tm0.extend(m0s)
        kv_row = self.kv_rows[rid]
        row_tables, row_slots = kv_row.tables, kv_row.write_slots
        slots, tables, widths = self.slots, self.tables, self.widths
        for g in range(self.ng):
            slots[g].extend(row_slots[g])
            t = row_tables[g]
            w = widths[g]
            tables[g][i, :len(t)] = t if len(t) <= w else t[:w]
            if self.count_kv:
                win = self.windows[g]
                self.kv_tokens[g] += min(st, win - 1) if win else st
        a = self.a
        self.q_start.append(a)
        self.q_len.append(n)
        self.past.append(st)
        if s.samples:
            self.rows[rid] = len(self.lidx)
            self.lidx.append(a + n - 1)
        self.a = a + n

    def write(self, trash: list[int], async_mode: bool) -> int:
        """Copy the packed rows into the buffer; a write slot of -1 goes to the group's `trash` slot (its
        write-padding block). Returns the tokens carried over.

        Raises:
            RuntimeError: a carried-over token in synchronous mode (the engine applied steps out of order).
        """
        lay, buf, a = self.lay, self.buf, self.a
        n_seqs = len(self.q_start)
        lay.view(buf, "ids")[:a] = self.ids
        lay.view(buf, "pos")[:a] = self.pos
        if self.carry_at:
            if not async_mode:
                raise RuntimeError("a token of an unapplied step in synchronous mode (the engine applied steps out of "
                                   "order)")
            lay.view(buf, "carry")[self.carry_at] = self.carry_row
        lay.view(buf, "logits_idx")[:len(self.lidx)] = self.lidx
        lay.view(buf, "q_start")[:n_seqs] = self.q_start
        lay.view(buf, "q_len")[:n_seqs] = self.q_len
        lay.view(buf, "past")[:n_seqs] = self.past
        if self.dec:
            lay.view(buf, "dec_seq")[:len(self.dec)] = self.dec
        if self.tseq:
            lay.view(buf, "tile_seq")[:len(self.tseq)] = self.tseq
            lay.view(buf, "tile_m0")[:len(self.tm0)] = self.tm0
        for g in range(self.ng):
            sv = np.asarray(self.slots[g], dtype=np.int32)
            sv[sv < 0] = trash[g]
            lay.view(buf, f"slots{g}")[:a] = sv
        return len(self.carry_at)
