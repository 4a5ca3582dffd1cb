"""Logits processors for the rows of a step, vectorised over rows (semantics and order: `cbnb.core.sampling_params`).

Per step, `build` turns the rows' `SamplingParams` and positions into a `ProcessorBatch` of a few device tensors
(host work proportional to the number of processor entries, not to the vocabulary), and `apply` runs every processor
as a handful of batched tensor operations over ``x [n, V]`` (fp32): no loop over requests or tokens on the device
side, and no host synchronisation (the only loop is over the distinct n-gram sizes and sequence-prefix lengths in the
step).

History: processors that read a request's tokens (repetition / frequency / presence penalties, no-repeat n-grams,
multi-token bad words and sequence biases) read them from `History`, a device buffer with one row per request. A
request's row is filled from the host (prompt + generated tokens) at its first such draw, and every later draw
appends the drawn token on the device, right after the draw. So the history is complete with async batching too
(the token of the step in flight is on the device before the next step reads it), and it survives offloads, soft
resets and reconfigures (it is keyed by request, not by KV blocks; a new runner refills it from the host, where no
sample is in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["History", "ProcessorBatch", "RowInfo", "build", "apply"]

_NEG_INF = float("-inf")


@dataclass
class RowInfo:
    """What `build` needs about one processed row (host side).

    Attributes:
        row: the row's index among the step's processed rows.
        params: its `SamplingParams`.
        request: the request (``request_id``, ``prompt_ids``, ``output_ids``, ``max_new_tokens``).
        length: tokens in its history before the drawn one (prompt + generated so far).
    """

    row: int
    params: Any
    request: Any
    length: int


class History:
    """Token histories on the device, one row per request (see the module docstring).

    Args:
        device: where the buffer lives.
        to_device: ``(numpy array) -> tensor`` copy (pinned and asynchronous on CUDA).
    """

    def __init__(self, device: torch.device, to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.device = device
        self._to_device = to_device
        self.buf: torch.Tensor | None = None  # [slots, width] int64
        self.slots: dict[str, int] = {}
        self._free: list[int] = []

    def forget(self, request_id: str) -> None:
        s = self.slots.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def _grow(self, rows: int, width: int) -> None:
        old = self.buf
        r0, w0 = (0, 0) if old is None else old.shape
        if rows <= r0 and width <= w0:
            return
        r1 = max(r0, 8)
        while r1 < rows:
            r1 *= 2
        w1 = max(w0, 64)
        while w1 < width:
            w1 *= 2
        buf = torch.zeros(r1, w1, dtype=torch.int64, device=self.device)
        if old is not None:
            buf[:r0, :w0].copy_(old)
        self.buf = buf

    def prepare(self, rows: Sequence[RowInfo]) -> list[int]:
        """Slots of `rows` (history-reading rows of a step), filling new ones from the host; the buffer is wide
        enough for every row's history plus the token drawn now.

        Raises:
            RuntimeError: a new request whose host-side tokens are incomplete (a sample in flight).
        """
        new: list[tuple[int, list[int]]] = []
        slots = []
        for r in rows:
            rid = r.request.request_id
            s = self.slots.get(rid)
            if s is None:
                s = self._free.pop() if self._free else len(self.slots) + len(self._free)
                self.slots[rid] = s
                known = list(r.request.prompt_ids) + list(r.request.output_ids)
                if len(known) != r.length:
                    raise RuntimeError(f"request {rid!r}: {len(known)} known tokens for a history of {r.length} "
                                       "(a sample in flight at its first processed draw)")
                new.append((s, known))
            slots.append(s)
        need_rows = max(self.slots.values(), default=-1) + 1
        self._grow(need_rows, max((r.length for r in rows), default=0) + 1)
        if new:
            flat = np.concatenate([np.asarray(k, dtype=np.int64) for _, k in new])
            where = np.concatenate([np.stack([np.full(len(k), s), np.arange(len(k))]) for s, k in new], axis=1)
            t = self._to_device(np.concatenate([where, flat[None]]).astype(np.int64))
            self.buf.index_put_((t[0], t[1]), t[2])
        return slots

    def append(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write each row's drawn token at its position (device only)."""
        self.buf.index_put_((slots, positions), tokens)


@dataclass
class _Seq:
    """Token sequences (bias or ban) whose last token is affected when the history ends with the prefix."""

    hist: torch.Tensor  # [E] index among the history rows
    rows: torch.Tensor  # [E] processed row
    prefix: torch.Tensor  # [E, P]
    last: torch.Tensor  # [E]
    value: torch.Tensor  # [E] fp32 (bias, or -inf)


@dataclass
class ProcessorBatch:
    """One step's processor parameters as device tensors (built by `build`; `apply` reads them)."""

    vocab: int
    add: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, bias (single tokens)
    seq_bias: list[_Seq] = field(default_factory=list)
    hist_rows: torch.Tensor | None = None  # [m] processed rows that read a history
    all_rows: bool = False  # hist_rows is every processed row, in order
    slots: torch.Tensor | None = None  # [m]
    lengths: torch.Tensor | None = None  # [m]
    prompt_lens: torch.Tensor | None = None  # [m]
    max_len: int = 0
    repetition: torch.Tensor | None = None  # [m, 1]
    frequency: torch.Tensor | None = None  # [m, 1]
    presence: torch.Tensor | None = None  # [m, 1]
    ngrams: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (n, indices among the history rows)
    seq_ban: list[_Seq] = field(default_factory=list)
    ban: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, tokens -> -inf (before forcing)
    force_rows: torch.Tensor | None = None  # rows whose only candidates are `force`
    force: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, tokens -> 0
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, tokens -> -inf (after forcing)


def build(rows: Sequence[RowInfo], history: History, vocab: int,
          to_device: Callable[[np.ndarray], torch.Tensor], n_rows: int = 0) -> ProcessorBatch | None:
    """The processor tensors of one step's processed rows (None when no row has a processor); `n_rows`: how many
    processed rows the step has (all of them, not only those in `rows`)."""
    rows = [r for r in rows if r.params.processors]
    if not rows:
        return None
    add: list[tuple[int, int, float]] = []
    ban: list[tuple[int, int]] = []
    force_rows: list[int] = []
    force: list[tuple[int, int]] = []
    suppress: list[tuple[int, int]] = []
    hist = [r for r in rows if r.params.needs_history]
    hist_index = {r.row: k for k, r in enumerate(hist)}
    seq_bias: dict[int, list[tuple[int, int, tuple[int, ...], int, float]]] = {}
    seq_ban: dict[int, list[tuple[int, int, tuple[int, ...], int, float]]] = {}
    for r in rows:
        p, req, i = r.params, r.request, r.row
        plen = len(req.prompt_ids)
        made = r.length - plen  # generated tokens before this one
        eos = p.eos_token_ids
        for seq, b in p.sequence_bias:
            if len(seq) == 1:
                add.append((i, seq[0], b))
            else:
                seq_bias.setdefault(len(seq) - 1, []).append((hist_index[i], i, seq[:-1], seq[-1], b))
        for t, b in p.logit_bias:
            add.append((i, t, b))
        for seq in p.bad_words_ids:
            if len(seq) == 1:
                if seq[0] not in eos:  # transformers drops a bad word that is an EOS id alone
                    ban.append((i, seq[0]))
            else:
                seq_ban.setdefault(len(seq) - 1, []).append((hist_index[i], i, seq[:-1], seq[-1], _NEG_INF))
        if r.length < p.min_length or made < p.min_new_tokens:
            ban.extend((i, t) for t in eos)
        forced: tuple[int, ...] = ()
        if p.forced_bos_token_id is not None and r.length == 1:
            forced = (p.forced_bos_token_id,)
        if p.forced_eos_token_id and req.max_new_tokens is not None and made == req.max_new_tokens - 1:
            forced = p.forced_eos_token_id
        if forced:
            force_rows.append(i)
            force.extend((i, t) for t in forced)
        suppress.extend((i, t) for t in p.suppress_tokens)
        begin = 1 if (plen == 1 and p.forced_bos_token_id is not None) else 0
        if made == begin:
            suppress.extend((i, t) for t in p.begin_suppress_tokens)
    batch = ProcessorBatch(vocab=vocab)
    # One host-to-device copy for the integer data and one for the floats.
    ints: list[np.ndarray] = []
    floats: list[np.ndarray] = []

    def put_i(a: Any) -> int:
        ints.append(np.asarray(a, dtype=np.int64).reshape(-1))
        return len(ints) - 1

    def put_f(a: Any) -> int:
        floats.append(np.asarray(a, dtype=np.float32).reshape(-1))
        return len(floats) - 1

    plan: dict[str, Any] = {}
    if add:
        plan["add"] = (put_i([a[0] for a in add]), put_i([a[1] for a in add]), put_f([a[2] for a in add]))
    for key, pairs in (("ban", ban), ("suppress", suppress), ("force", force)):
        if pairs:
            plan[key] = (put_i([a[0] for a in pairs]), put_i([a[1] for a in pairs]))
    if force_rows:
        plan["force_rows"] = put_i(force_rows)
    for key, groups in (("seq_bias", seq_bias), ("seq_ban", seq_ban)):
        plan[key] = [(P, put_i([e[0] for e in es]), put_i([e[1] for e in es]), put_i([e[2] for e in es]),
                      put_i([e[3] for e in es]), put_f([e[4] for e in es])) for P, es in sorted(groups.items())]
    if hist:
        slots = history.prepare(hist)
        plan["hist"] = (put_i([r.row for r in hist]), put_i(slots), put_i([r.length for r in hist]),
                        put_i([len(r.request.prompt_ids) for r in hist]))
        batch.max_len = max(r.length for r in hist)
        batch.all_rows = [r.row for r in hist] == list(range(n_rows))
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            vals = [getattr(r.params, name) for r in hist]
            neutral = 1.0 if name == "repetition_penalty" else 0.0
            if any(v != neutral for v in vals):
                plan[name] = put_f(vals)
        sizes: dict[int, list[int]] = {}
        for k, r in enumerate(hist):
            if r.params.no_repeat_ngram_size > 0:
                sizes.setdefault(r.params.no_repeat_ngram_size, []).append(k)
        plan["ngrams"] = [(n, put_i(ks)) for n, ks in sorted(sizes.items())]
    iv = _split(ints, to_device)
    fv = _split(floats, to_device)
    if "add" in plan:
        a, b, c = plan["add"]
        batch.add = (iv[a], iv[b], fv[c])
    for key in ("ban", "suppress", "force"):
        if key in plan:
            a, b = plan[key]
            setattr(batch, key, (iv[a], iv[b]))
    if "force_rows" in plan:
        batch.force_rows = iv[plan["force_rows"]]
    for key in ("seq_bias", "seq_ban"):
        setattr(batch, key, [_Seq(iv[h], iv[rw], iv[pf].view(-1, P), iv[ls], fv[v])
                             for P, h, rw, pf, ls, v in plan[key]])
    if "hist" in plan:
        a, b, c, d = plan["hist"]
        batch.hist_rows, batch.slots, batch.lengths, batch.prompt_lens = iv[a], iv[b], iv[c], iv[d]
        for name, attr in (("repetition_penalty", "repetition"), ("frequency_penalty", "frequency"),
                           ("presence_penalty", "presence")):
            if name in plan:
                setattr(batch, attr, fv[plan[name]].unsqueeze(1))
        batch.ngrams = [(n, iv[k]) for n, k in plan["ngrams"]]
    return batch


def _split(parts: list[np.ndarray], to_device: Callable[[np.ndarray], torch.Tensor]) -> list[torch.Tensor]:
    if not parts:
        return []
    sizes = [len(p) for p in parts]
    flat = to_device(np.concatenate(parts))
    return list(torch.split(flat, sizes))


# ------------------------------------------------------------------------------------------------ device side
def _rows_apply(x: torch.Tensor, rows: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x[rows] = fn(x[rows])`` for unique `rows`, without boolean indexing."""
    return x.index_copy_(0, rows, fn(x.index_select(0, rows)))


def _sequences(x: torch.Tensor, seqs: list[_Seq], history: History, batch: ProcessorBatch) -> torch.Tensor:
    for s in seqs:
        P = s.prefix.shape[1]
        length = batch.lengths.index_select(0, s.hist)  # [E]
        pos = length.unsqueeze(1) - P + torch.arange(P, device=x.device)  # the history's last P positions
        slot = batch.slots.index_select(0, s.hist).unsqueeze(1)
        tail = history.buf[slot, pos.clamp(min=0)]
        match = (tail == s.prefix).all(1) & (length >= P)
        x.index_put_((s.rows, s.last), torch.where(match, s.value, torch.zeros_like(s.value)), accumulate=True)
    return x


def apply(x: torch.Tensor, batch: ProcessorBatch, history: History) -> torch.Tensor:
    """Run the step's processors over ``x [n, V]`` (fp32, modified in place) in the order of
    `cbnb.core.sampling_params`; returns x."""
    if batch.add is not None:
        rows, toks, bias = batch.add
        x.index_put_((rows, toks), bias, accumulate=True)
    x = _sequences(x, batch.seq_bias, history, batch)
    if batch.hist_rows is not None:
        width = max(batch.max_len, 1)
        h = history.buf.index_select(0, batch.slots)[:, :width]  # [m, L]
        pos = torch.arange(width, device=x.device).unsqueeze(0)
        valid = pos < batch.lengths.unsqueeze(1)
        # Positions past a row's history point at its first token: a duplicate of a real entry, so a gather /
        # scatter of them rewrites a value already written (every history has at least the prompt's first token).
        idx = torch.where(valid, h, h[:, :1])
        if batch.repetition is not None or batch.frequency is not None or batch.presence is not None:
            xs = x if batch.all_rows else x.index_select(0, batch.hist_rows)
            if batch.repetition is not None:
                g = xs.gather(1, idx)
                pen = batch.repetition
                xs.scatter_(1, idx, torch.where(g < 0, g * pen, g / pen))
            gen = (valid & (pos >= batch.prompt_lens.unsqueeze(1))).to(xs.dtype)  # generated tokens only
            if batch.frequency is not None:
                xs.scatter_add_(1, idx, -gen * batch.frequency)
            if batch.presence is not None:
                seen = torch.zeros_like(xs).scatter_add_(1, idx, gen).clamp_(max=1.0)
                xs.sub_(seen * batch.presence)
            if not batch.all_rows:
                x.index_copy_(0, batch.hist_rows, xs)
        for n, sel in batch.ngrams:
            x = _no_repeat(x, n, sel, h, batch)
    x = _sequences(x, batch.seq_ban, history, batch)
    if batch.ban is not None:
        x.index_put_(batch.ban, x.new_full((1,), _NEG_INF))
    if batch.force_rows is not None:
        x.index_fill_(0, batch.force_rows, _NEG_INF).index_put_(batch.force, x.new_full((1,), 0.0))
    if batch.suppress is not None:
        x.index_put_(batch.suppress, x.new_full((1,), _NEG_INF))
    return x


def _no_repeat(x: torch.Tensor, n: int, sel: torch.Tensor, h: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
    """Ban each token that would complete an n-gram already in the row's history: every window of n tokens whose
    first n - 1 equal the history's last n - 1 bans its n-th."""
    V = x.shape[-1]
    width = h.shape[1]
    if width < n:
        return x
    hs = h.index_select(0, sel)  # [g, L]
    length = batch.lengths.index_select(0, sel)  # [g]
    windows = hs.unfold(1, n, 1)  # [g, W, n]
    W = windows.shape[1]
    suffix_pos = (length.unsqueeze(1) - (n - 1) + torch.arange(n - 1, device=x.device)).clamp(min=0)
    suffix = hs.gather(1, suffix_pos)  # [g, n - 1]
    match = (windows[..., :-1] == suffix.unsqueeze(1)).all(-1)  # [g, W]
    match = match & (torch.arange(W, device=x.device).unsqueeze(0) <= (length - n).unsqueeze(1))
    banned = torch.where(match, windows[..., -1], V)
    mask = torch.zeros(hs.shape[0], V + 1, dtype=torch.bool, device=x.device).scatter_(1, banned, True)[:, :V]
    rows = batch.hist_rows.index_select(0, sel)
    return _rows_apply(x, rows, lambda xs: xs.masked_fill(mask, _NEG_INF))
