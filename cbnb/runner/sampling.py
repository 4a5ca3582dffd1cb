"""Token sampling for the rows of a step: one batched pass over all rows, without host synchronisation (except for
rows with a grammar: their drawn ids are read on the host, where their matchers live).

Pipeline, in transformers' order, on the rows that need it (`SamplingParams.plain` is False: they sample, have logits
processors or a grammar, or want logprobs), in fp32:

1. logits processors (`cbnb.runner.processors`: the request's own, over its full history; then the grammar mask of
   the rows with structured output, `cbnb.runner.grammar`, whose matchers advance with each drawn token; then
   `Sampler.processors`, extra ``(x [n, V] fp32, rows) -> x`` hooks, none by default);
2. warpers (`WARPERS`), on the rows that sample: temperature, then top-k (keep the k largest), then top-p (keep the
   smallest set of most likely tokens whose mass reaches `top_p`, at least one), then min-p (keep tokens whose
   probability is at least `min_p` times the largest, i.e. ``x >= max(x) + log(min_p)``); per-row parameters are
   tensors, so rows with different settings share each pass; filtered entries become -inf;
3. one draw for every row: plain greedy rows take the argmax of the raw logits; processed greedy rows the argmax of
   their processed logits; sampling rows the Gumbel-max of their processed logits, ``argmax(x + G)`` with
   ``G = -log(-log U)``, which draws exactly from ``softmax(x)`` (Gumbel 1954; see Maddison, Tarlow & Minka,
   "A* Sampling", NeurIPS 2014, section 2);
4. the step's report ``[S, c]`` (float64, one row per logits row): column 0 is 1 where the row's logits (processed
   ones for processed rows) have no finite maximum (NaN, +inf, or every token ruled out): that request fails alone
   (`unpack`), never the batch; with logprobs, column 1 holds the drawn token's ``log_softmax`` of the processed
   logits, then the ids and logprobs of the K most likely tokens (K: the largest `logprobs` in the step).

The noise is counter-based, not drawn from a stateful generator: ``U`` for (row, token) is a hash of the row's key and
the token id, and a row's key is 62 bits of a BLAKE2 hash of (the request's ``seed``, the index of the output token
being drawn). A seeded sample is therefore a function of the request and its logits only: the same whatever else
shares the batch, synchronous or async, with graphs or not, after an offload, a soft reset or a reconfigure. A request
without a seed is keyed by (the engine seed, its ordinal among the unseeded requests this engine has sampled, in the
order of their first draw, the index): reproducible for the same workload under the same
`ContinuousBatchingConfig.seed` (random per engine when unset). ``U`` has 23 random bits, so ``G`` lies in
[-2.8, 16.6]: a token whose processed logit is more than ~19 below the row's maximum is never drawn (its probability
is below e^-19 = 6e-9).

Cost per step (CPU): no sort. The noise is about 30 in-place int32/fp32 passes over the ``[rows that sample, vocab]``
block, a few rows at a time (`_noise_into`, the same values as `gumbel_noise`); top-p on CPU is lazy (`Sampler.draw`:
one exp pass, then a masked sum per round on the rows whose Gumbel winner fell outside the nucleus); argmaxes are
two vectorised passes (`_argmax`); plus one max over every row's logits (the finiteness check). An explicit top-p
mask (`Sampler.process`, rows that want logprobs, and every row on an accelerator) still sorts. Top-p keeps every
token tied with the smallest kept one (a threshold, so the kept set does not depend on how a sort orders ties).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..core.requests import TokenLogprob
from . import grammar as grammar_masks
from . import processors as procs
from .noise import _M31, _argmax, _noise_into, _scratch, gumbel_noise, row_key

__all__ = ["Sampler", "SamplingRows", "StepReport", "WARPERS", "gumbel_noise", "row_key", "unpack"]

@dataclass
class SamplingRows:
    """The processed rows of a step, with their parameters as device tensors (built by `Sampler.rows`).

    Attributes:
        index: ``[n]`` int64, logits rows on the processed path.
        temperature, top_p: ``[n, 1]`` fp32 (1.0: off); log_min_p: ``[n, 1]`` fp32 (-inf: off).
        top_k: ``[n, 1]`` int64 (0: off). Greedy rows carry the neutral values.
        key_lo, key_hi: ``[n, 1]`` int64, the two 31-bit halves of each row's noise key (`row_key`).
        sample: ``[n, 1]`` bool, rows that draw (the others take the argmax), or None when all of them draw.
        max_top_k: the largest top-k in use (0: none); any_temperature, any_top_p, any_min_p, any_sample.
        params: the rows' `SamplingParams` (host side, for processors).
        processors: the rows' `cbnb.runner.processors.ProcessorBatch`, or None.
        append: (history slots, positions, row indices) of the rows whose drawn token joins their history.
        logprob_rows: ``[r]`` int64, indices (among the n) of the rows that want logprobs, or None.
        max_logprobs: K, the largest `logprobs` in the step.
        sample_rows: host list of the rows that draw (indices among the n); sample_index: the same as ``[s]`` int64
            on the device, or None when every row draws.
        lazy_rows / lazy: the rows whose top-p `Sampler.draw` applies lazily (host list / ``[l]`` int64; CPU
            sampler, top_p < 1, no logprobs; see `Sampler.draw`), or None; eager_top_p: ``[r]`` int64, the other
            rows with top_p < 1 (an explicit, sorted mask), or None.
        defer_top_p: set by `Sampler.draw` while its warpers run: `warp_top_p` leaves the lazy rows unmasked and
            stores `nucleus` = (``e [l, V]`` fp32, ``exp(x - max)`` of their top-k-filtered logits; ``P [l, 1]``,
            ``top_p * e.sum()``).
        workspace: the sampler's reusable buffers while `Sampler.draw` runs (None otherwise).
        grammar: the rows with a grammar and their token bitmasks (`cbnb.runner.grammar.GrammarRows`), or None.
    """

    index: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    sample: torch.Tensor | None
    max_top_k: int
    any_temperature: bool
    any_top_p: bool
    any_min_p: bool
    any_sample: bool
    params: list[Any]
    processors: Any = None
    append: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    logprob_rows: torch.Tensor | None = None
    max_logprobs: int = 0
    sample_rows: list[int] | None = None
    sample_index: torch.Tensor | None = None
    lazy_rows: list[int] | None = None
    eager_top_p: torch.Tensor | None = None
    lazy: torch.Tensor | None = None
    defer_top_p: bool = False
    nucleus: tuple[torch.Tensor, torch.Tensor] | None = None
    workspace: dict | None = None
    grammar: grammar_masks.GrammarRows | None = None

    def __len__(self) -> int:
        return len(self.params)


def warp_temperature(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    return x.div_(rows.temperature) if rows.any_temperature else x  # in place: x is the sampler's own copy


def warp_top_k(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    if not rows.max_top_k:
        return x
    k = rows.top_k
    vals = torch.topk(x, min(rows.max_top_k, x.shape[-1]), dim=-1).values
    kth = vals.gather(1, (k - 1).clamp(min=0, max=vals.shape[-1] - 1))
    kth = torch.where(k > 0, kth, torch.full_like(kth, float("-inf")))
    return x.masked_fill_(x < kth, float("-inf"))  # ties with the k-th value stay (transformers' TopKLogitsWarper)


def _top_p_sorted(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p mask of ``x [r, V]`` (``top_p [r, 1]`` fp32) by a full sort, in place: an ascending sort, the
    cumulative softmax, and every entry below the smallest kept value set to -inf (transformers' TopPLogitsWarper
    arithmetic; tokens tied with the smallest kept one are all kept)."""
    sorted_x = torch.sort(x, dim=-1, descending=False).values
    cum = sorted_x.softmax(-1).cumsum(-1)
    dropped = (cum <= (1 - top_p)).sum(-1, keepdim=True)  # a prefix of the ascending order
    thr = sorted_x.gather(1, dropped.clamp(max=x.shape[-1] - 1))  # the most likely token always stays
    return x.masked_fill_(x < thr, float("-inf"))


def warp_top_p(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Top-p. Explicitly (a sort) on the rows with top_p < 1, except, while `Sampler.draw` runs (`defer_top_p`),
    the lazy rows: for them it stores ``exp(x - max)`` and the mass to reach, and the draw tests its winner."""
    if not rows.any_top_p:
        return x
    if rows.defer_top_p and rows.lazy is not None:
        xl = x if rows.lazy_rows == list(range(len(rows))) else x.index_select(0, rows.lazy)
        e = torch.sub(xl, xl.amax(-1, keepdim=True), out=_scratch(rows.workspace, "e", xl.shape, xl)).exp_()
        rows.nucleus = (e, e.sum(-1, keepdim=True) * rows.top_p.index_select(0, rows.lazy))
        eager = rows.eager_top_p
    else:
        parts = [t for t in (rows.eager_top_p, rows.lazy) if t is not None]
        eager = (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else None
    if eager is None:
        return x
    if eager.shape[0] == x.shape[0]:  # every row: no gather (the order of the rows does not matter here)
        return _top_p_sorted(x, rows.top_p)
    return x.index_copy_(0, eager, _top_p_sorted(x.index_select(0, eager), rows.top_p.index_select(0, eager)))


def warp_min_p(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    if not rows.any_min_p:
        return x
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); the maximum itself always stays
    return x.masked_fill_(x < x.amax(-1, keepdim=True) + rows.log_min_p, float("-inf"))


#: The warpers, in order: ``(x [n, V] fp32, rows) -> x``.
WARPERS: tuple[Callable[[torch.Tensor, SamplingRows], torch.Tensor], ...] = (
    warp_temperature, warp_top_k, warp_top_p, warp_min_p)


@dataclass
class StepReport:
    """What the host reads back for a step besides the tokens (see `unpack`).

    Attributes:
        data: ``[S, c]`` float64 on the device (the module docstring, step 4, gives the columns).
        max_logprobs: K (c = 2 + 2K when any row wants logprobs, else 1).
        logprobs: whether any row wants logprobs.
    """

    data: torch.Tensor
    max_logprobs: int = 0
    logprobs: bool = False

    @property
    def columns(self) -> int:
        return self.data.shape[1]


class Sampler:
    """Samples one token per logits row (see the module docstring for the semantics).

    Args:
        device: where logits live.
        seed: the engine seed for requests without their own (None: random for this sampler).
        lazy_top_p: draw top-p rows without sorting (`draw`), which reads a few flags on the host per step: free on
            CPU, a synchronisation on an accelerator. None (default): on CPU only.

    Attributes:
        processors: extra logits processors applied after the requests' own, ``(x [n, V] fp32, rows) -> x``.
        history: the requests' token histories on the device (`cbnb.runner.processors.History`).
    """

    def __init__(self, device: torch.device, seed: int | None = None, lazy_top_p: bool | None = None) -> None:
        self.device = torch.device(device)
        self.lazy_top_p = self.device.type == "cpu" if lazy_top_p is None else bool(lazy_top_p)
        self._seed_given = seed is not None
        self.engine_seed = int(seed) if seed is not None else random.SystemRandom().getrandbits(62)
        self.processors: list[Callable[[torch.Tensor, SamplingRows], torch.Tensor]] = []
        self.history = procs.History(self.device, self._to_device)
        self.constraints = grammar_masks.Constraints(self._to_device)  # structured output's matchers
        self._ws: dict[str, torch.Tensor] = {}  # buffers reused by every draw (noise, exp, masked sums)
        self._ordinals: dict[str, int] = {}  # unseeded request -> ordinal of its first draw
        self._next_ordinal = 0

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request (an unseeded request's ordinal, its token history)."""
        self._ordinals.pop(request_id, None)
        self.history.forget(request_id)
        self.constraints.forget(request_id)

    def adopt(self, other: "Sampler") -> None:
        """Continue `other`'s unseeded streams (an engine rebuilt by `reconfigure`): its ordinals, and its engine seed
        unless this sampler was given one, so a request that survives the rebuild draws as in an uninterrupted run.
        (Token histories are refilled from the host at the next draw.)"""
        if not self._seed_given:
            self.engine_seed = other.engine_seed
        self._ordinals.update(other._ordinals)
        self._next_ordinal = max(self._next_ordinal, other._next_ordinal)

    def _ordinal(self, request_id: str) -> int:
        n = self._ordinals.get(request_id)
        if n is None:
            n = self._ordinals[request_id] = self._next_ordinal
            self._next_ordinal += 1
        return n

    # ---------------------------------------------------------------------------------------------- host side
    def rows(self, entries: Sequence[Any], vocab: int | None = None) -> SamplingRows | None:
        """The processed rows of a step, one logits row per entry (in order), or None when every row is plain
        greedy.

        `entries` are the step's sampling `ScheduledRequest`s (``request_id``, ``start``, ``num_tokens``,
        ``request.sampling``, ``request.prompt_ids``, ``request.output_ids``, ``request.tokens_left``,
        ``request.max_new_tokens``). A row past its ``max_new_tokens`` (async batching: the step in flight already
        produced the last token) is never applied and not drawn. Parameters travel in a few small host-to-device
        copies (pinned and asynchronous on CUDA).
        """
        ints: list[tuple[int, int, int, int, int]] = []
        floats: list[tuple[float, float, float]] = []
        params = []
        infos: list[procs.RowInfo] = []
        want_lp: list[int] = []
        constrained: list[tuple[int, Any, int]] = []
        for i, s in enumerate(entries):
            req = s.request
            p = req.sampling
            if p.plain:
                continue
            left = req.tokens_left
            if left is not None and left < 0:
                continue
            n = len(params)
            length = s.start + s.num_tokens  # history before the drawn token
            if p.greedy:
                ints.append((i, 0, 0, 0, 0))
                floats.append((1.0, 1.0, -math.inf))
            else:
                index = length - len(req.prompt_ids)  # the output token this row draws
                key = (row_key(p.seed, index) if p.seed is not None
                       else row_key(self.engine_seed, index, self._ordinal(s.request_id)))
                ints.append((i, p.top_k or 0, key & _M31, key >> 31, 1))
                floats.append((float(p.temperature), float(p.top_p) if p.top_p is not None else 1.0,
                               math.log(p.min_p) if p.min_p else -math.inf))
            params.append(p)
            if p.processors:
                infos.append(procs.RowInfo(n, p, req, length))
            if p.logprobs is not None:
                want_lp.append(n)
            if p.grammar is not None:
                constrained.append((n, req, length - len(req.prompt_ids)))
        if not params:
            return None
        iv = self._to_device(np.asarray(ints, dtype=np.int64).T.copy())
        fv = self._to_device(np.asarray(floats, dtype=np.float32).T.copy())
        sample_flags = [t[4] for t in ints]
        top_p_rows = [n for n, (t, f) in enumerate(zip(ints, floats)) if t[4] and f[1] < 1.0]
        lazy_rows = [n for n in top_p_rows if self.lazy_top_p and params[n].logprobs is None]
        eager = [n for n in top_p_rows if n not in set(lazy_rows)]
        srows = [n for n, f in enumerate(sample_flags) if f]
        batch = procs.build(infos, self.history, vocab or 0, self._to_device, len(params)) if infos else None
        append = None
        if batch is not None and batch.hist_rows is not None:  # the drawn token joins the row's history
            append = (batch.slots, batch.lengths, batch.hist_rows)
        return SamplingRows(
            index=iv[0], top_k=iv[1].unsqueeze(1), key_lo=iv[2].unsqueeze(1), key_hi=iv[3].unsqueeze(1),
            sample=None if all(sample_flags) else iv[4].unsqueeze(1).bool(),
            temperature=fv[0].unsqueeze(1), top_p=fv[1].unsqueeze(1), log_min_p=fv[2].unsqueeze(1),
            max_top_k=max(t[1] for t in ints), any_temperature=any(f[0] != 1.0 for f in floats),
            any_top_p=any(f[1] < 1.0 for f in floats), any_min_p=any(f[2] > -math.inf for f in floats),
            any_sample=any(sample_flags), params=params, processors=batch, append=append,
            logprob_rows=self._to_device(np.asarray(want_lp, dtype=np.int64)) if want_lp else None,
            max_logprobs=max((params[n].logprobs for n in want_lp), default=0),
            sample_rows=srows, sample_index=(None if len(srows) == len(params) else
                                             self._to_device(np.asarray(srows, dtype=np.int64))),
            lazy_rows=lazy_rows or None,
            lazy=self._to_device(np.asarray(lazy_rows, dtype=np.int64)) if lazy_rows else None,
            eager_top_p=self._to_device(np.asarray(eager, dtype=np.int64)) if eager else None,
            grammar=self.constraints.masks(constrained) if constrained else None)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ---------------------------------------------------------------------------------------------- device side
    def process(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """The processed logits ``[n, V]`` (fp32) of the rows: processors, then warpers on the rows that sample
        (every filter explicit: filtered entries are -inf)."""
        return self._process(logits, rows, False)

    def _process(self, logits: torch.Tensor, rows: SamplingRows, defer: bool) -> torch.Tensor:
        x = logits.index_select(0, rows.index).float()  # a copy: the processors and warpers work in place
        if rows.processors is not None:
            x = procs.apply(x, rows.processors, self.history)
        if rows.grammar is not None:
            x = grammar_masks.apply(x, rows.grammar)
        for fn in self.processors:
            x = fn(x, rows)
        if rows.any_sample:
            rows.defer_top_p, rows.nucleus = defer, None
            rows.workspace = self._ws if defer else None
            try:
                for fn in WARPERS:
                    x = fn(x, rows)
            finally:
                rows.defer_top_p, rows.workspace = False, None
        return x

    def draw(self, logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Drawn ids ``[n]`` (int64, on the logits' device) of the rows in `rows`, from ``logits [S, V]``, and their
        processed logits ``[n, V]`` (fp32; the lazy rows' without their top-p mask, see below). One batched pass:
        processors, warpers, Gumbel-max; no host synchronisation unless `lazy_top_p`.

        Lazy top-p (`lazy_top_p`, rows without logprobs): no sort. The nucleus is a top set (a token is in it iff
        the mass of the tokens strictly more likely is below ``top_p`` times the total, so with a token every more
        likely one is in it), hence the Gumbel-max winner over the nucleus is the first token, in the order of
        ``x + G``, that belongs to it. The row's winner w over all tokens is tested (one masked sum); if it is
        out, so is every token with ``x <= x_w``: those are removed and the test repeats on the rows that failed
        (about 1 - top_p of the rows per round; the row's most likely token always passes, so it ends). The token
        drawn is the one the sorted mask would give, up to the rounding of the two sums at the nucleus boundary."""
        x = self._process(logits, rows, True)
        return self._draw(x, rows), x

    def _draw(self, x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        if not rows.any_sample:
            tok = _argmax(x)
        else:
            n = x.shape[0]
            srows = rows.sample_rows if rows.sample_rows is not None else list(range(n))
            every = len(srows) == n
            sel = None if every else (rows.sample_index if rows.sample_index is not None else
                                      torch.tensor(srows, dtype=torch.int64, device=x.device))
            xs = x if every else x.index_select(0, sel)
            keys = ((rows.key_lo, rows.key_hi) if every else
                    (rows.key_lo.index_select(0, sel), rows.key_hi.index_select(0, sel)))
            noisy = _noise_into(_scratch(self._ws, "noisy", xs.shape, xs), *keys, ws=self._ws)
            noisy += xs  # x + G, as argmax(x + G) of the reference
            tok_s = _argmax(noisy)
            if rows.nucleus is not None:
                where = {r: i for i, r in enumerate(srows)}
                pos = [where[r] for r in rows.lazy_rows]
                tok_s = self._nucleus_draw(xs, noisy, tok_s, pos, *rows.nucleus, ws=self._ws)
            tok = tok_s if every else _argmax(x).index_copy_(0, sel, tok_s)
        rows.nucleus = None
        if rows.append is not None:
            slots, pos_, which = rows.append
            self.history.append(slots, pos_, tok.index_select(0, which))
        return tok

    @staticmethod
    def _nucleus_draw(x: torch.Tensor, noisy: torch.Tensor, tok: torch.Tensor, pos: list[int], e: torch.Tensor,
                      mass: torch.Tensor, ws: dict | None = None) -> torch.Tensor:
        """The lazy top-p draw (see `draw`) of rows `pos` of ``x``/``noisy`` ``[s, V]``, whose winners over all
        tokens are ``tok [s]``; ``e [l, V]`` and ``mass [l, 1]`` from `warp_top_p`. Returns tok, updated."""
        full = pos == list(range(x.shape[0]))
        act = torch.tensor(pos, dtype=torch.int64, device=x.device)  # rows of x still being tested
        cx, cn = (x, noisy) if full else (x.index_select(0, act), noisy.index_select(0, act))
        ce, cm = e, mass
        w = tok if full else tok.index_select(0, act)
        out = tok.clone()
        while True:
            xw = cx.gather(1, w.unsqueeze(1))
            masked = torch.where(cx > xw, ce, ce.new_zeros(()), out=_scratch(ws, "masked", ce.shape, ce))
            above = masked.sum(-1, keepdim=True)
            fail = (above >= cm).squeeze(1)  # NaN (every token ruled out, or NaN logits: the row fails) passes
            if not bool(fail.any()):  # a host read: free on CPU (lazy_top_p is off elsewhere by default)
                return out
            k = fail.nonzero().squeeze(1)
            act, cx, cn, ce, cm, xw = (t.index_select(0, k) for t in (act, cx, cn, ce, cm, xw))
            cn.masked_fill_(cx <= xw, float("-inf"))  # the winner and every token not more likely are out
            w = _argmax(cn)
            out.index_copy_(0, act, w)

    def sample(self, logits: torch.Tensor, entries: Sequence[Any],
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, StepReport]:
        """One token per row of ``logits [S, V]`` (row i belongs to ``entries[i]``): int64 ``[S]`` on the device,
        and the step's `StepReport`.

        Plain greedy rows get the argmax (written into `out` when given, e.g. a graph's static output that already
        holds it: then only the processed rows are written). Rows of `logits` past ``len(entries)`` (a padded
        graph's) are ignored. Raises nothing for empty input (returns ``[0]``)."""
        S = min(len(entries), logits.shape[0])
        logits = logits[:S]
        top = logits.amax(-1)  # the finiteness check
        rows = self.rows(entries, logits.shape[-1]) if S else None
        if out is None:  # every row drawn below: no argmax of the raw logits
            out = (torch.empty(S, dtype=torch.int64, device=logits.device) if rows is not None and len(rows) == S
                   else _argmax(logits))
        bad = ~torch.isfinite(top)
        if rows is None:
            return out, StepReport(bad.to(torch.float64).unsqueeze(1))
        tok, x = self.draw(logits, rows)
        if rows.grammar is not None:
            self.constraints.advance(rows.grammar, tok)
        out.index_copy_(0, rows.index, tok)
        bad = bad.index_copy(0, rows.index, ~torch.isfinite(x.amax(-1)))
        K = rows.max_logprobs
        if rows.logprob_rows is None:
            return out, StepReport(bad.to(torch.float64).unsqueeze(1))
        report = torch.zeros(S, 2 + 2 * K, dtype=torch.float64, device=logits.device)
        report[:, 0] = bad.to(torch.float64)
        sel = rows.logprob_rows
        lp = torch.log_softmax(x.index_select(0, sel), -1)
        part = [lp.gather(1, tok.index_select(0, sel).unsqueeze(1))]
        if K:
            top = torch.topk(lp, K, dim=-1)
            part += [top.indices.to(lp.dtype), top.values]
        bad_sel = bad.index_select(0, rows.index.index_select(0, sel)).unsqueeze(1).to(lp.dtype)
        block = torch.cat([bad_sel] + part, 1).to(torch.float64)
        report.index_copy_(0, rows.index.index_select(0, sel), block)
        return out, StepReport(report, K, True)


def unpack(entries: Sequence[Any], tokens: Sequence[int], report: Sequence[Sequence[float]],
           max_logprobs: int = 0) -> tuple[dict[str, int], dict[str, TokenLogprob], dict[str, str]]:
    """A step's results on the host: (request id -> token, request id -> `TokenLogprob` for the requests that want
    logprobs, request id -> error for the rows whose logits were not finite: those requests fail, the others go on).

    Args:
        entries: the step's sampling entries, in row order.
        tokens: the drawn ids, one per row.
        report: `StepReport.data` rows as lists (columns in the module docstring, step 4).
        max_logprobs: the report's K.
    """
    toks: dict[str, int] = {}
    lps: dict[str, TokenLogprob] = {}
    bad: dict[str, str] = {}
    K = max_logprobs
    for e, t, r in zip(entries, tokens, report):
        rid = e.request_id
        if r[0]:
            req = e.request
            index = e.start + e.num_tokens - len(req.prompt_ids)
            bad[rid] = (f"the logits of output token {index} are not finite (NaN or inf, or every token was ruled "
                        f"out by the logits processors); sampling: {', '.join(req.sampling.describe())}")
            continue
        toks[rid] = int(t)
        k = e.request.sampling.logprobs
        if k is not None and len(r) > 1:
            top = tuple((int(r[2 + j]), float(r[2 + K + j])) for j in range(min(k, K))
                        if r[2 + K + j] != -math.inf)
            lps[rid] = TokenLogprob(int(t), float(r[1]), top)
    return toks, lps, bad
