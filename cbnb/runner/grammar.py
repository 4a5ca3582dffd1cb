"""Grammar masks for the rows of a step (structured output, `cbnb.engine.structured`), one llguidance matcher per
request.

Per step, `Constraints.masks` gives the token bitmask ``[g, W]`` (int32, ``W = ceil(V / 32)``, bit ``t % 32`` of
word ``t // 32`` set when token t is allowed) of the step's g constrained rows; `apply` turns it into -inf on the
disallowed tokens of ``x [n, V]`` (fp32) in one batched pass, after the request's own logits processors and before
the warpers, so greedy and sampled rows draw only tokens the grammar accepts (and logprobs are those of the masked
distribution). Once a grammar is complete, EOS is allowed (llguidance's EOS ids, which are the engine's, plus the
request's own `eos_token_ids`); once it cannot go on, only EOS is.

The matcher advances in `advance`, right after the draw, with each constrained row's drawn token (a host read of
those few ids: one device synchronisation per step on an accelerator, none extra on CPU). It then computes the
next step's masks on a worker thread (llguidance releases the GIL), so that work overlaps the engine's update and
the next forward; `masks` waits for it, or computes the masks itself for rows it has none for (a request's first
constrained draw). A matcher is created at a request's first constrained draw, fast-forwarded over the tokens it
already generated (known on the host then: a new runner after `reconfigure`, a request restored from the host),
and dropped by `forget` (finished, cancelled or failed requests). Timings: `stats` (seconds spent computing masks,
waiting for them, and steps).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["Constraints", "GrammarRows", "apply"]

_NEG_INF = float("-inf")


@dataclass
class _State:
    grammar: Any
    matcher: Any
    eos: tuple[int, ...]
    consumed: int = 0  # generated tokens the matcher has consumed
    ahead: tuple[int, np.ndarray] | None = None  # (consumed, its mask row) computed in the background


@dataclass
class GrammarRows:
    """One step's constrained rows: ``rows [g]`` (int64, indices among the step's processed rows) and their
    ``bits [g, W]`` (int32) on the device (or, on CPU, `banned`); `ids` are the request ids, in the same order
    (host)."""

    rows: torch.Tensor
    bits: torch.Tensor | None
    ids: list[str]
    banned: torch.Tensor | None = None  # CPU: ``[g, 32 W]`` bool, unpacked on the host (no device pass)
    leading: bool = False  # the rows are 0..g-1: masked in place, no gather


@dataclass
class Stats:
    """Host time of the grammar work, in seconds: `compute_s` (masks computed while the step waited), `ahead_s`
    (masks computed on the worker thread, overlapped), `wait_s` (the step waited for the worker), `advance_s`
    (consuming drawn tokens, host read included); `steps`, `rows`: steps and constrained rows masked."""

    compute_s: float = 0.0
    ahead_s: float = 0.0
    wait_s: float = 0.0
    advance_s: float = 0.0
    steps: int = 0
    rows: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class Constraints:
    """The matchers of one sampler's constrained requests (see the module docstring).

    Args:
        to_device: ``(numpy array) -> tensor`` copy to the sampler's device.
    """

    def __init__(self, to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self._to_device = to_device
        self._states: dict[str, _State] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[_State], Future] | None = None
        self._first: dict[int, tuple[Any, np.ndarray]] = {}  # id(grammar) -> (grammar, its mask at the start)
        self.stats = Stats()

    def __len__(self) -> int:
        return len(self._states)

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (finished, cancelled or failed)."""
        if self._states.pop(request_id, None) is not None and not self._states:
            self.close()  # no thread is kept while no request is constrained

    def close(self) -> None:
        """Stop the worker thread (a later `advance` starts a new one)."""
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------------------------------------ masks
    def _state(self, request: Any, made: int) -> _State:
        rid = request.request_id
        st = self._states.get(rid)
        p = request.sampling
        if st is None or st.grammar is not p.grammar:
            st = self._states[rid] = _State(p.grammar, p.grammar.matcher(), tuple(sorted(p.eos_token_ids)))
        if st.consumed != made:  # a new runner, or tokens this sampler did not draw: replay the host's tokens
            known = list(request.output_ids)
            if len(known) < made:
                raise RuntimeError(f"request {rid!r}: the grammar matcher is at token {st.consumed} but the request "
                                   f"drew {made} and the host knows {len(known)}")
            st.matcher.reset()
            st.matcher.consume_tokens([t for t in known[:made] if t not in st.eos])
            st.consumed, st.ahead = made, None
        return st

    def _fill(self, states: Sequence[_State], words: int) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask_par

        out = np.zeros((len(states), words), dtype=np.int32)
        if states:
            fill_next_token_bitmask_par(_executor(), [(s.matcher, i) for i, s in enumerate(states)], out)
        u = out.view(np.uint32)
        for i, s in enumerate(states):
            if s.eos and (s.matcher.is_accepting() or s.matcher.is_stopped()) and not s.matcher.is_error():
                for t in s.eos:
                    if t < words * 32:
                        u[i, t >> 5] |= np.uint32(1 << (t & 31))
        return out

    def _settle(self) -> None:
        """Wait for the background masks (timed as `wait_s`): no matcher is touched while the worker reads it."""
        job, self._pending = self._pending, None
        if job is None:
            return
        t0 = time.perf_counter()
        states, out = job[0], job[1].result()
        self.stats.wait_s += time.perf_counter() - t0
        for i, st in enumerate(states):
            st.ahead = (st.consumed, out[i])

    def masks(self, items: Sequence[tuple[int, Any, int]]) -> GrammarRows | None:
        """The bitmasks of the constrained rows of a step.

        Args:
            items: (processed row index, request, tokens it generated before this draw) per constrained row.

        Raises:
            RuntimeError: a request whose matcher cannot be brought to its generated tokens (a sample in flight
                that this sampler did not draw).
        """
        self._settle()
        if not items:
            return None
        states = [self._state(req, made) for _, req, made in items]
        words = (states[0].grammar.tokenizer.vocab_size + 31) // 32
        bits = np.zeros((len(states), words), dtype=np.int32)
        todo = []
        t0 = time.perf_counter()
        for i, st in enumerate(states):
            ahead, st.ahead = st.ahead, None
            first = self._first.get(id(st.grammar)) if st.consumed == 0 else None
            if ahead is not None and ahead[0] == st.consumed and ahead[1].shape[0] == words:
                bits[i] = ahead[1]
            elif first is not None and first[0] is st.grammar and first[1].shape[0] == words:
                bits[i] = first[1]  # every request of a grammar starts with the same mask
            else:
                todo.append(i)
        if todo:
            lead: dict[int, int] = {}  # id(grammar) -> the first row at its start: its mask serves the others
            same: list[tuple[int, int]] = []
            own = []
            for i in todo:
                key = id(states[i].grammar)
                if states[i].consumed == 0 and key in lead:
                    same.append((i, lead[key]))
                    continue
                if states[i].consumed == 0:
                    lead[key] = i
                own.append(i)
            bits[own] = self._fill([states[i] for i in own], words)
            for i, j in same:
                bits[i] = bits[j]
            for i in lead.values():
                if len(self._first) > 64:
                    self._first.clear()
                self._first[id(states[i].grammar)] = (states[i].grammar, bits[i].copy())
        self.stats.steps += 1
        self.stats.rows += len(states)
        rows = [r for r, _, _ in items]
        out = GrammarRows(self._to_device(np.asarray(rows, dtype=np.int64)), None,
                          [req.request_id for _, req, _ in items], leading=rows == list(range(len(rows))))
        probe = out.rows
        if probe.device.type == "cpu":  # unpack on the host: one numpy pass, little-endian bit order as llguidance's
            out.banned = torch.from_numpy(np.unpackbits((~bits).view(np.uint8), axis=1, bitorder="little")).view(
                torch.bool)
        else:
            out.bits = self._to_device(bits)
        self.stats.compute_s += time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------------------------------------- advance
    def advance(self, g: GrammarRows, tokens: torch.Tensor) -> None:
        """Consume each constrained row's drawn token (``tokens [n]``, the step's processed rows) and start the
        next masks on the worker thread."""
        self._settle()
        t0 = time.perf_counter()
        drawn = tokens.index_select(0, g.rows).tolist()
        moved = []
        for rid, t in zip(g.ids, drawn):
            st = self._states.get(rid)
            if st is None:
                continue
            if t not in st.eos and not st.matcher.is_stopped():
                st.matcher.consume_token(int(t))  # an allowed token: never fails
            st.consumed += 1
            st.ahead = None
            moved.append(st)
        self.stats.advance_s += time.perf_counter() - t0
        if not moved:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        words = (moved[0].grammar.tokenizer.vocab_size + 31) // 32
        self._pending = (moved, self._pool.submit(self._ahead, moved, words))

    def _ahead(self, states: list[_State], words: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = self._fill(states, words)
        self.stats.ahead_s += time.perf_counter() - t0
        return out


_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(num_threads=2)
    return _EXECUTOR


def apply(x: torch.Tensor, g: GrammarRows) -> torch.Tensor:
    """-inf on the tokens of ``x [n, V]`` (fp32, in place) that the rows' grammars do not allow; returns x. Tokens
    past the bitmask's width (a model vocabulary larger than the tokenizer's) are not allowed."""
    V = x.shape[-1]
    banned = g.banned
    if banned is None:
        shifts = torch.arange(32, dtype=torch.int32, device=x.device)
        banned = ((g.bits.unsqueeze(-1) >> shifts) & 1).view(g.bits.shape[0], -1) == 0  # [g, 32 W]
    W = banned.shape[1]
    if W < V:
        banned = torch.nn.functional.pad(banned, (0, V - W), value=True)
    banned = banned[:, :V]
    if g.leading:
        x[:banned.shape[0]].masked_fill_(banned, _NEG_INF)
        return x
    xs = x.index_select(0, g.rows).masked_fill_(banned, _NEG_INF)
    return x.index_copy_(0, g.rows, xs)
