"""Token sampling for the rows of a step: one batched pass over all rows, without host synchronisation.

Pipeline, in transformers' order, on the rows that sample (``do_sample``), in fp32:

1. logits processors (`Sampler.processors`; none by default): ``(x [S, V], rows) -> x``;
2. warpers (`WARPERS`): temperature, then top-k (keep the k largest), then top-p (keep the smallest set of most likely
   tokens whose mass reaches `top_p`, at least one); per-row parameters are tensors, so rows with different settings
   share each pass; filtered entries become -inf;
3. one draw for every row: greedy rows take the argmax of the raw logits; sampling rows the Gumbel-max of their
   processed logits, ``argmax(x + G)`` with ``G = -log(-log U)``, which draws exactly from ``softmax(x)`` (Gumbel 1954;
   see Maddison, Tarlow & Minka, "A* Sampling", NeurIPS 2014, section 2).

The noise is counter-based, not drawn from a stateful generator: ``U`` for (row, token) is a hash of the row's key and
the token id, and a row's key is 62 bits of a BLAKE2 hash of (the request's ``seed``, the index of the output token
being drawn). A seeded sample is therefore a function of the request and its logits only: the same whatever else
shares the batch, synchronous or async, with graphs or not, after an offload, a soft reset or a reconfigure. A request
without a seed is keyed by (the engine seed, its ordinal among the unseeded requests this engine has sampled, in the
order of their first draw, the index): reproducible for the same workload under the same
`ContinuousBatchingConfig.seed` (random per engine when unset). ``U`` has 23 random bits, so ``G`` lies in
[-2.8, 16.6]: a token whose processed logit is more than ~19 below the row's maximum is never drawn (its probability
is below e^-19 = 6e-9). Cost: about 25 elementwise passes over the ``[rows that sample, vocab]`` int64 block per step.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["Sampler", "SamplingRows", "WARPERS", "gumbel_noise", "row_key"]

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B  # odd multiplier of a well-known 32-bit integer hash; products stay below 2**63 on 31-bit values
_SALT = 0x2545F491


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) with good avalanche (xorshift-multiply rounds, int64 without overflow)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def row_key(seed: int, index: int, ordinal: int | None = None) -> int:
    """The 62-bit noise key of one draw: the output token `index` of a request with `seed` (or, with `ordinal`, of
    the `ordinal`-th unseeded request under the engine seed `seed`)."""
    text = f"s:{seed}:{index}" if ordinal is None else f"e:{seed}:{ordinal}:{index}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


_TOKEN_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    t = _TOKEN_HASH.get(key)
    if t is None:
        t = _TOKEN_HASH[key] = _mix31(torch.arange(vocab, dtype=torch.int64, device=device) ^ _SALT)
    return t


def gumbel_noise(key_lo: torch.Tensor, key_hi: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[S, vocab]`` (fp32) for rows with 31-bit key halves ``key_lo``/``key_hi`` ``[S, 1]``
    (int64, same device). Deterministic: equal keys give equal rows on any device."""
    h = _mix31(_mix31(_token_hash(vocab, key_lo.device) ^ key_lo) ^ key_hi)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # (0, 1), exact in fp32
    return -torch.log(-torch.log(u))


@dataclass
class SamplingRows:
    """The rows of one step that sample, with their parameters as device tensors (built by `Sampler.rows`).

    Attributes:
        index: ``[n]`` int64, logits rows that sample.
        temperature, top_p: ``[n, 1]`` fp32 (1.0: off).
        top_k: ``[n, 1]`` int64 (0: off).
        key_lo, key_hi: ``[n, 1]`` int64, the two 31-bit halves of each row's noise key (`row_key`).
        max_top_k: the largest top-k in use (0: none); any_temperature, any_top_p: whether any row uses them.
        params: the rows' `SamplingParams` (host side, for processors).
    """

    index: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    max_top_k: int
    any_temperature: bool
    any_top_p: bool
    params: list[Any]

    def __len__(self) -> int:
        return len(self.params)


def warp_temperature(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    return x / rows.temperature if rows.any_temperature else x


def warp_top_k(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    if not rows.max_top_k:
        return x
    k = rows.top_k
    vals = torch.topk(x, min(rows.max_top_k, x.shape[-1]), dim=-1).values
    kth = vals.gather(1, (k - 1).clamp(min=0, max=vals.shape[-1] - 1))
    kth = torch.where(k > 0, kth, torch.full_like(kth, float("-inf")))
    return x.masked_fill(x < kth, float("-inf"))


def warp_top_p(x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    if not rows.any_top_p:
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    cum = sorted_x.softmax(-1).cumsum(-1)
    drop = cum <= (1 - rows.top_p)  # rows with top_p = 1 drop only entries that are already -inf (mass 0)
    drop[:, -1] = False  # always keep the most likely token
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


#: The warpers, in order: ``(x [n, V] fp32, rows) -> x``.
WARPERS: tuple[Callable[[torch.Tensor, SamplingRows], torch.Tensor], ...] = (
    warp_temperature, warp_top_k, warp_top_p)


class Sampler:
    """Samples one token per logits row (see the module docstring for the semantics).

    Args:
        device: where logits live.
        seed: the engine seed for requests without their own (None: random for this sampler).

    Attributes:
        processors: logits processors applied before the warpers, ``(x [n, V] fp32, rows) -> x``.
    """

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._seed_given = seed is not None
        self.engine_seed = int(seed) if seed is not None else random.SystemRandom().getrandbits(62)
        self.processors: list[Callable[[torch.Tensor, SamplingRows], torch.Tensor]] = []
        self._ordinals: dict[str, int] = {}  # unseeded request -> ordinal of its first draw
        self._next_ordinal = 0

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request (an unseeded request's ordinal)."""
        self._ordinals.pop(request_id, None)

    def adopt(self, other: "Sampler") -> None:
        """Continue `other`'s unseeded streams (an engine rebuilt by `reconfigure`): its ordinals, and its engine seed
        unless this sampler was given one, so a request that survives the rebuild draws as in an uninterrupted run."""
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
    def rows(self, entries: Sequence[Any]) -> SamplingRows | None:
        """The sampling rows of a step, one logits row per entry (in order), or None when every row is greedy.

        `entries` are the step's sampling `ScheduledRequest`s (``request_id``, ``start``, ``num_tokens``,
        ``request.sampling``, ``request.prompt_ids``, ``request.tokens_left``). A row past its ``max_new_tokens``
        (async batching: the step in flight already produced the last token) is never applied and not drawn.
        Parameters travel in two small host-to-device copies (pinned and asynchronous on CUDA).
        """
        ints: list[tuple[int, int, int, int]] = []
        floats: list[tuple[float, float]] = []
        params = []
        for i, s in enumerate(entries):
            req = s.request
            p = req.sampling
            if not p.do_sample:
                continue
            left = req.tokens_left
            if left is not None and left < 0:
                continue
            index = s.start + s.num_tokens - len(req.prompt_ids)  # the output token this row draws
            key = (row_key(p.seed, index) if p.seed is not None
                   else row_key(self.engine_seed, index, self._ordinal(s.request_id)))
            ints.append((i, p.top_k or 0, key & _M31, key >> 31))
            floats.append((float(p.temperature), float(p.top_p) if p.top_p is not None else 1.0))
            params.append(p)
        if not params:
            return None
        iv = self._to_device(np.asarray(ints, dtype=np.int64).T.copy())
        fv = self._to_device(np.asarray(floats, dtype=np.float32).T.copy())
        return SamplingRows(index=iv[0], top_k=iv[1].unsqueeze(1), key_lo=iv[2].unsqueeze(1),
                            key_hi=iv[3].unsqueeze(1), temperature=fv[0].unsqueeze(1), top_p=fv[1].unsqueeze(1),
                            max_top_k=max(k for _, k, _, _ in ints), any_temperature=any(t != 1.0 for t, _ in floats),
                            any_top_p=any(q < 1.0 for _, q in floats), params=params)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ---------------------------------------------------------------------------------------------- device side
    def draw(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """Sampled ids ``[n]`` (int64, on the logits' device) of the rows in `rows`, from ``logits [S, V]``.
        One batched pass: processors, warpers, Gumbel-max; no host synchronisation."""
        x = logits.index_select(0, rows.index).float()
        for fn in self.processors:
            x = fn(x, rows)
        for fn in WARPERS:
            x = fn(x, rows)
        return (x + gumbel_noise(rows.key_lo, rows.key_hi, x.shape[-1])).argmax(-1)

    def sample(self, logits: torch.Tensor, entries: Sequence[Any], out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits [S, V]`` (row i belongs to ``entries[i]``): int64 ``[S]`` on the device.

        Greedy rows get the argmax (written into `out` when given, e.g. a graph's static output that already holds
        it: then only the sampling rows are written). Raises nothing for empty input (returns ``[0]``)."""
        if out is None:
            out = logits.argmax(-1)
        rows = self.rows(entries) if logits.shape[0] else None
        if rows is not None:
            out.index_copy_(0, rows.index, self.draw(logits, rows))
        return out
