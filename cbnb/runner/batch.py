"""Flat varlen batch for one step: token tensors plus, per layer group, the paged-attention metadata.

All requests of a step are packed into one sequence of T query tokens (``input_ids``/``position_ids`` ``[1, T]``,
``cu_seqlens_q`` ``[B + 1]``). Per layer group the attention needs:

- **write slots** ``(write_block, write_offset)`` ``[T]``: where each token's K/V goes (the write-padding block
  for tokens a sliding layer does not keep);
- **decode rows** (one query token with a past): with the CPU kernel (`cbnb.runner.cpu.cpu_kernels`, float32 on CPU),
  all of them in one call per layer from their block tables ``[Bd, max_pages]`` and key counts ``[Bd]``, reading
  the pages in place; otherwise (the torch path) a row whose keys fit in one page attends to that page in place
  (no copy: a page's slots are contiguous) and the others gather their pages ``[Bd, max_pages]`` (padded with the
  zero read-padding block), masked to each row's length, in one batched attention call;
- **prefill rows**: with the CPU kernel, the rows of a full-attention group in one call per layer from their block
  tables ``[Bp, max_pages]``, first rows, pasts and chunk lengths ``[Bp]`` (causal over the pages, after the write);
  otherwise (and for sliding groups) one by one: "fresh" (no past: attend to the chunk's own K/V, causal), "paged"
  (full attention with a past: read the request's pages after writing) or "ring" (sliding attention with a past:
  read the previous ``window - 1`` tokens *before* writing, since the chunk overwrites ring slots they occupy).

Cost grows with the real KV lengths of the batch, never with the size of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core.plan import ScheduledRequest, StepKV, decode_slot
from .cpu import cpu_kernels

__all__ = ["PrefillRow", "GroupBatch", "StepBatch", "build_step_batch"]


@dataclass
class PrefillRow:
    """One multi-token (or pastless) chunk: query rows [a, b) at positions [past, past + b - a)."""

    a: int
    b: int
    past: int
    mode: str  # "fresh", "paged" or "ring"
    pages: torch.Tensor | None = None  # paged: [n_pages]
    length: int = 0  # paged: keys read (= past + chunk)
    old_blocks: torch.Tensor | None = None  # ring: [n_old]
    old_offsets: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [chunk, keys] bool, True = attend; None = plain causal
    causal: bool = True


@dataclass
class GroupBatch:
    """Paged-attention metadata of one layer group for one step."""

    window: int | None
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    write_rows: torch.Tensor | None = None  # [T] token rows of the group's first layer's K (see KVStore.token_rows)
    dec_rows: torch.Tensor | None = None
    dec_pages: torch.Tensor | None = None
    dec_mask: torch.Tensor | None = None  # [Bd, 1, 1, dec_keys] bool
    dec_keys: int = 0  # keys read per decode row (the longest row's valid keys)
    dec_single: list[tuple[int, int, int]] = field(default_factory=list)  # (row, page, valid keys), one page each
    dec_lens: torch.Tensor | None = None  # kernel path: [Bd] keys per row (dec_rows, dec_pages and dec_keys set too)
    prefill: list[PrefillRow] = field(default_factory=list)
    # kernel path for the prefill rows of a full-attention group: [Bp] first query row, past (tokens) and chunk
    # length, and [Bp, max_pages] block tables (padded with the read-padding block)
    pre_rows: torch.Tensor | None = None
    pre_starts: torch.Tensor | None = None
    pre_counts: torch.Tensor | None = None
    pre_pages: torch.Tensor | None = None


@dataclass
class StepBatch:
    """Everything the model forward of one step needs (passed to attention as the `cbnb_batch` kwarg)."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    logits_indices: torch.Tensor  # [S] long: rows whose logits are kept
    sample_entries: list[ScheduledRequest]  # the S requests that sample, in row order
    groups: list[GroupBatch]
    layer_group: list[tuple[int, int]]  # layer -> (group, index in group)
    store: Any  # the KVStore
    num_tokens: int = 0


def _window_mask(n_q: int, n_old: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Mask for queries at chunk offsets 0..n_q-1 over [n_old cached keys, n_q chunk keys].

    Query j sits at position past + j; cached key i at past - n_old + i. True = attend.
    """
    qpos = torch.arange(n_q, device=device).unsqueeze(1) + n_old
    kpos = torch.arange(n_old + n_q, device=device).unsqueeze(0)
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m


def _block_tables(tables: list[list[int]], pad: int) -> np.ndarray:
    """The rows' block tables as one ``[rows, longest]`` int64 array, short rows padded with block `pad`."""
    out = np.full((len(tables), max(len(t) for t in tables)), pad, dtype=np.int64)
    for r, t in enumerate(tables):
        out[r, :len(t)] = t
    return out


def build_step_batch(entries: list[ScheduledRequest], kv: StepKV, store: Any, device: torch.device) -> StepBatch:
    """Pack the scheduled requests of a step into a `StepBatch` on `device`, from the step's own KV data (`kv`, the
    plan's `StepWork.kv`: block tables and slots; the cache manager is never read)."""
    P = kv.page_size
    kernel = device.type == "cpu" and getattr(store, "dtype", None) == torch.float32 and cpu_kernels.available()
    kernel_prefill = kernel and cpu_kernels.prefill_enabled()
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    logits_idx: list[int] = []
    samplers: list[ScheduledRequest] = []
    kv_groups = kv.groups
    n_groups = len(kv_groups)
    w_blk: list[list[int]] = [[] for _ in range(n_groups)]
    w_off: list[list[int]] = [[] for _ in range(n_groups)]
    dec: list[list[tuple[int, list[int], int]]] = [[] for _ in range(n_groups)]
    pre: list[list[PrefillRow]] = [[] for _ in range(n_groups)]
    kpre: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in range(n_groups)]  # (row, past, n, pages)
    for s in entries:
        req = s.request
        a = len(ids)
        ids.extend(req.token_ids(s.start, s.end))
        pos.extend(range(s.start, s.end))
        b = len(ids)
        cu.append(b)
        if s.samples:
            logits_idx.append(b - 1)
            samplers.append(s)
        row = kv.rows[req.request_id]
        n = s.num_tokens
        for g, grp in enumerate(kv_groups):
            wpad = grp.write_padding_block
            table = row.tables[g]
            window = grp.window or None
            wslots = row.write_slots[g] if row.write_slots is not None else [decode_slot(table, s.start, grp.window, P)]
            for slot in wslots:
                if slot < 0:
                    w_blk[g].append(wpad)
                    w_off[g].append(0)
                else:
                    w_blk[g].append(slot // P)
                    w_off[g].append(slot % P)
            if n == 1 and s.start > 0:
                if window is None:
                    valid = s.start + 1
                    pages = table[: -(-valid // P)]
                else:
                    valid = min(s.start + 1, window)
                    pages = table
                dec[g].append((a, list(pages), valid))
            elif kernel_prefill and window is None:
                kpre[g].append((a, s.start, n, list(table[: -(-(s.start + n) // P)])))
            elif s.start == 0:
                mask = None
                if window is not None and n > window:
                    mask = _window_mask(n, 0, window, device)
                pre[g].append(PrefillRow(a, b, 0, "fresh", mask=mask))
            elif window is None:
                length = s.start + n
                pages = torch.tensor(table[: -(-length // P)], dtype=torch.long, device=device)
                mask = _window_mask(n, s.start, None, device)
                pre[g].append(PrefillRow(a, b, s.start, "paged", pages=pages, length=length, mask=mask))
            else:
                slots = row.window_slots[g]
                lo = s.start - len(slots)
                ob = torch.tensor([x // P for x in slots], dtype=torch.long, device=device)
                oo = torch.tensor([x % P for x in slots], dtype=torch.long, device=device)
                mask = _window_mask(n, s.start - lo, window, device)
                pre[g].append(PrefillRow(a, b, s.start, "ring", old_blocks=ob, old_offsets=oo, mask=mask))
    groups = []
    for g, grp in enumerate(kv_groups):
        gb = GroupBatch(
            window=grp.window or None,
            write_blocks=torch.tensor(w_blk[g], dtype=torch.long, device=device),
            write_offsets=torch.tensor(w_off[g], dtype=torch.long, device=device),
            prefill=pre[g],
        )
        if getattr(store, "token_rows", None) is not None:
            rpb = store.rows_per_block[g]
            gb.write_rows = torch.tensor([b * rpb + o for b, o in zip(w_blk[g], w_off[g])], dtype=torch.long,
                                         device=device)
        if kpre[g]:
            d = kpre[g]
            meta = np.array([x[:3] for x in d], dtype=np.int64).T.copy()  # [3, Bp]: rows, pasts, lengths
            gb.pre_rows, gb.pre_starts, gb.pre_counts = (torch.from_numpy(m) for m in meta)
            gb.pre_pages = torch.from_numpy(_block_tables([x[3] for x in d], grp.read_padding_block))
        if dec[g] and kernel:
            d = dec[g]
            lens = np.fromiter((v for _, _, v in d), dtype=np.int64, count=len(d))
            gb.dec_rows = torch.tensor([a for a, _, _ in d], dtype=torch.long)
            gb.dec_pages = torch.from_numpy(_block_tables([pg for _, pg, _ in d], grp.read_padding_block))
            gb.dec_lens = torch.from_numpy(lens)
            gb.dec_keys = int(lens.max())
        elif dec[g]:
            # Rows whose keys sit in one page attend to that page in place (no copy); the others are batched
            # over gathered pages, padded to the longest of them.
            single = [(a, pg[0], v) for a, pg, v in dec[g] if len(pg) == 1]
            multi = [d for d in dec[g] if len(d[1]) > 1]
            gb.dec_single = single
            if multi:
                rows = [d[0] for d in multi]
                valid = np.fromiter((d[2] for d in multi), dtype=np.int64, count=len(rows))
                keys = int(valid.max())
                width = -(-keys // P)  # pages that hold the longest row's keys
                pages = np.full((len(rows), width), grp.read_padding_block, dtype=np.int64)
                for r, (_, pg, _v) in enumerate(multi):
                    m = min(len(pg), width)
                    pages[r, :m] = pg[:m]
                gb.dec_rows = torch.tensor(rows, dtype=torch.long, device=device)
                gb.dec_pages = torch.from_numpy(pages).to(device)
                gb.dec_keys = keys
                ar = torch.arange(keys, device=device)
                gb.dec_mask = (ar.unsqueeze(0) < torch.from_numpy(valid).to(device).unsqueeze(1))[:, None, None, :]
        groups.append(gb)
    t = len(ids)
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0),
        position_ids=torch.tensor(pos, dtype=torch.long, device=device).unsqueeze(0),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=device),
        sample_entries=samplers,
        groups=groups,
        layer_group=store.layer_group,
        store=store,
        num_tokens=t,
    )
