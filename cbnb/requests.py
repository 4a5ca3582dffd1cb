"""Requests: lifecycle states, sampling parameters, per-request bookkeeping and outputs (torch-free).

Lifecycle (as in transformers, plus CANCELLED)::

    PENDING ──▶ PREFILLING ──▶ DECODING ──▶ FINISHED
       │  └──────────────────────▲  │
       │        (whole remaining prompt fits in one step)
       ▼            ▼              ▼
    FAILED / CANCELLED from any non-terminal state;  PREFILLING/DECODING ──▶ PENDING on offload (swap or soft reset)
    FINISHED also from PENDING / PREFILLING, only with finish reason "cache_exhausted" (a re-queued or recomputing
    request whose tokens outgrew the whole cache)

Transitions happen at scheduling time, as in transformers: a request whose remaining prompt fits in this step's
token budget goes straight to DECODING before its prefill forward runs; a prompt split across steps is PREFILLING
until its last chunk is scheduled. Every transition is time-stamped (`time.perf_counter()` seconds).

Token accounting is uniform for prefill and decode. A request's tokens are ``prompt_ids + output_ids`` plus
``pending_samples`` placeholders (tokens sampled by a step whose result has not been applied yet, which only happens
with async batching). ``num_computed`` tokens have their K/V in the cache (or in the swap pool); the next step must
process ``remaining = num_tokens - num_computed`` tokens, and the step that processes the last of them samples a new
token. A soft reset sets ``num_computed`` to 0 (prompt and generated tokens are recomputed, progress kept).
"""

from __future__ import annotations

import enum
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

__all__ = [
    "CACHE_EXHAUSTED",
    "FINISH_REASONS",
    "MAX_SOURCE_CHARS",
    "RequestState",
    "IllegalTransition",
    "SamplingParams",
    "Request",
    "RequestOutput",
    "RequestTimings",
    "TokenDelta",
]


class RequestState(enum.IntEnum):
    """Request states. Terminal states are >= FINISHED (transformers' convention, plus CANCELLED)."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def is_terminal(self) -> bool:
        return self >= RequestState.FINISHED


#: Finish reasons of a terminal request: FINISHED ends with "eos", "length" or "cache_exhausted" (it outgrew the
#: whole KV cache, see `cbnb.core`); CANCELLED with "cancelled"; FAILED with "error".
CACHE_EXHAUSTED = "cache_exhausted"
FINISH_REASONS = ("eos", "length", CACHE_EXHAUSTED, "cancelled", "error")

_S = RequestState
ALLOWED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.PENDING: frozenset({_S.PREFILLING, _S.DECODING, _S.FINISHED, _S.FAILED, _S.CANCELLED}),
    _S.PREFILLING: frozenset({_S.PREFILLING, _S.DECODING, _S.PENDING, _S.FINISHED, _S.FAILED, _S.CANCELLED}),
    _S.DECODING: frozenset({_S.DECODING, _S.FINISHED, _S.PENDING, _S.FAILED, _S.CANCELLED}),
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """Raised when a request is moved to a state that its current state does not allow."""


def _pos_int(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1), or None: bounded by the model's max positions.
        do_sample: False -> greedy (argmax); True -> sample from the processed distribution.
        temperature: > 0; applied before top-k/top-p when sampling.
        top_k: keep the k most likely tokens (>= 1), or None for no top-k.
        top_p: nucleus mass in (0, 1], or None for no top-p.
        seed: per-request RNG seed (an int), or None for the engine's RNG.
        eos_token_ids: token ids that end the request (the EOS token is included in the output). Negative ids are
            ignored, as in transformers (-1 means "no EOS").
        ignore_eos: never stop on EOS (benchmarks).

    Raises:
        ValueError: naming the field and its allowed range.
    """

    max_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            _pos_int("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False; got {self.do_sample!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0) or t == float("inf"):
            raise ValueError(f"temperature must be a finite number > 0; got {t!r}")
        if self.top_k is not None:
            _pos_int("top_k", self.top_k, 1)
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1)):
            raise ValueError(f"top_p must be a number in (0, 1] or None; got {p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None; got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False; got {self.ignore_eos!r}")
        object.__setattr__(self, "eos_token_ids", self.normalize_eos(self.eos_token_ids, "eos_token_ids"))

    @staticmethod
    def normalize_eos(eos: int | Iterable[int] | None, name: str = "eos_token_id") -> frozenset[int]:
        """An EOS spec (an id, a list/tuple/set of ids, or None) as a set of non-negative ids.

        Raises:
            ValueError: naming `name`, for anything else (text, floats, bools, nested lists).
        """
        if eos is None:
            return frozenset()
        items = eos if isinstance(eos, (list, tuple, set, frozenset)) else [eos]
        ids = []
        for i in items:
            try:
                v = operator.index(i) if not isinstance(i, bool) else None
            except TypeError:
                v = None
            if v is None:
                raise ValueError(f"{name} must be a token id, a list of token ids or None; got {eos!r}")
            if v >= 0:
                ids.append(int(v))
        return frozenset(ids)


@dataclass
class RequestTimings:
    """Wall-clock marks of a request (`time.perf_counter()` seconds; None until reached)."""

    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: queued -> first token (seconds)."""
        if self.queued is None or self.first_token is None:
            return None
        return self.first_token - self.queued

    @property
    def queue_s(self) -> float | None:
        """Time spent waiting before the first scheduling (seconds)."""
        if self.queued is None or self.scheduled is None:
            return None
        return self.scheduled - self.queued

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: queued -> terminal (seconds)."""
        if self.queued is None or self.finished is None:
            return None
        return self.finished - self.queued


_ARRIVAL = itertools.count()

#: The longest `Request.source` accepted (characters).
MAX_SOURCE_CHARS = 512


class Request:
    """One generation request and its engine-side bookkeeping.

    Args:
        request_id: unique id (str).
        prompt_ids: the prompt's token ids (non-empty).
        sampling: a `SamplingParams`.
        max_new_tokens_cap: the effective limit when `sampling.max_new_tokens` is None (model max positions minus
            the prompt length); must be >= 1.
        source: who sent it, free text shown on the dashboard's board (e.g. "http 127.0.0.1:53211"); None: a
            call from the notebook. At most `MAX_SOURCE_CHARS` characters.

    Raises:
        ValueError: on an empty prompt, a non-integer / negative token id, or a `source` that is too long.
        TypeError: on a `source` that is neither a string nor None.
    """

    __slots__ = (
        "request_id", "prompt_ids", "output_ids", "sampling", "max_new_tokens", "state", "arrival",
        "transitions", "timings", "num_computed", "pending_samples", "prefix_cached_tokens", "num_offloads",
        "num_soft_resets", "swapped", "error", "finish_reason", "warning", "text", "user_data", "token_times",
        "source", "_phase_has_output",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        max_new_tokens_cap: int | None = None,
        now: float | None = None,
        source: str | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string; got {request_id!r}")
        if source is not None:
            if not isinstance(source, str):
                raise TypeError(f"source must be a string or None; got {type(source).__name__}")
            if len(source) > MAX_SOURCE_CHARS:
                raise ValueError(f"source must be at most {MAX_SOURCE_CHARS} characters; got {len(source)}")
        ids = []
        for i in prompt_ids:
            # Accept any integer-like id (numpy / torch integer scalars), stored as a plain int.
            try:
                v = operator.index(i) if not isinstance(i, bool) else -1
            except TypeError:
                v = -1
            if v < 0:
                raise ValueError(f"prompt token ids must be non-negative integers; got {i!r}")
            ids.append(int(v))
        if not ids:
            raise ValueError("prompt must contain at least one token; got an empty prompt")
        self.request_id = request_id
        self.prompt_ids: list[int] = ids
        self.output_ids: list[int] = []
        self.token_times: list[float] = []  # when each output token was appended (perf_counter s, or `now`)
        self.sampling = sampling or SamplingParams()
        limit = self.sampling.max_new_tokens
        if limit is None:
            limit = max_new_tokens_cap
        if limit is not None and limit < 1:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room to generate (max_new_tokens limit {limit})"
            )
        self.max_new_tokens: int | None = limit
        self.state = RequestState.PENDING
        self.arrival = next(_ARRIVAL)
        t = time.perf_counter() if now is None else now
        self.transitions: list[tuple[RequestState, float]] = [(RequestState.PENDING, t)]
        self.timings = RequestTimings(queued=t)
        self.num_computed = 0
        self.pending_samples = 0
        self.prefix_cached_tokens = 0
        self.num_offloads = 0
        self.num_soft_resets = 0
        self.swapped = False
        self.error: str | None = None
        self.finish_reason: str | None = None  # one of FINISH_REASONS
        self.warning: str | None = None  # set at admission when the request can never fit the cache
        self.text: str = ""
        self.user_data: Any = None
        self.source: str | None = source

    # ------------------------------------------------------------------------------------------ token accounting
    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, including placeholders of in-flight samples."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending_samples

    @property
    def remaining(self) -> int:
        """Tokens the next step(s) must process before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        """True when the next step is a plain decode: one token left and generation already started."""
        return self.remaining == 1 and (len(self.output_ids) + self.pending_samples) > 0 and not self.swapped

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Known token ids at positions [start, stop); -1 marks placeholders of in-flight samples."""
        known = len(self.prompt_ids) + len(self.output_ids)
        out: list[int] = []
        if start < len(self.prompt_ids):
            out.extend(self.prompt_ids[start:min(stop, len(self.prompt_ids))])
        lo = max(start, len(self.prompt_ids))
        hi = min(stop, known)
        if hi > lo:
            off = len(self.prompt_ids)
            out.extend(self.output_ids[lo - off:hi - off])
        if stop > known:
            out.extend([-1] * (stop - max(start, known)))
        return out

    def all_known_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    @property
    def tokens_left(self) -> int | None:
        """How many more tokens may be generated (None: unbounded)."""
        if self.max_new_tokens is None:
            return None
        return self.max_new_tokens - len(self.output_ids) - self.pending_samples

    # ------------------------------------------------------------------------------------------ state machine
    def transition(self, new: RequestState, now: float | None = None) -> None:
        """Move to `new`, time-stamping it.

        Raises:
            IllegalTransition: when the current state does not allow `new`.
        """
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"request {self.request_id!r}: illegal transition {self.state.name} -> {RequestState(new).name}"
            )
        if new == self.state:
            return
        t = time.perf_counter() if now is None else now
        self.state = RequestState(new)
        self.transitions.append((self.state, t))
        if self.state in (RequestState.PREFILLING, RequestState.DECODING) and self.timings.scheduled is None:
            self.timings.scheduled = t
        if self.state.is_terminal:
            self.timings.finished = t

    # ------------------------------------------------------------------------------------------ generation
    def append_token(self, token: int, now: float | None = None) -> bool:
        """Record a sampled token (consuming one in-flight placeholder if there is one).

        Returns:
            True when the request is now complete (EOS produced or max_new_tokens reached). EOS is included in
            `output_ids`, as in transformers.
        """
        if self.pending_samples > 0:
            self.pending_samples -= 1
        self.output_ids.append(int(token))
        t = time.perf_counter() if now is None else now
        self.token_times.append(t)
        if self.timings.first_token is None:
            self.timings.first_token = t
        if not self.sampling.ignore_eos and token in self.sampling.eos_token_ids:
            self.finish_reason = "eos"
            return True
        if self.max_new_tokens is not None and len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    def output(self) -> "RequestOutput":
        """A snapshot of this request as a `RequestOutput`."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            text=self.text,
            state=self.state,
            error=self.error,
            finish_reason=self.finish_reason,
            warning=self.warning,
            timings=RequestTimings(**vars(self.timings)),
            prefix_cached_tokens=self.prefix_cached_tokens,
            num_offloads=self.num_offloads,
            num_soft_resets=self.num_soft_resets,
            max_new_tokens=self.max_new_tokens,
            source=self.source,
            token_times=list(self.token_times),
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.name}, prompt={len(self.prompt_ids)}, "
            f"out={len(self.output_ids)}, computed={self.num_computed})"
        )


@dataclass
class RequestOutput:
    """What a caller gets back for one request.

    Attributes:
        request_id: the id given or generated at submit.
        prompt_token_ids: the original prompt (also after soft resets).
        token_ids: generated token ids (EOS included when produced).
        text: decoded `token_ids` (empty when the engine has no tokenizer).
        state: FINISHED, FAILED or CANCELLED for a final output; PENDING/PREFILLING/DECODING for a snapshot.
        error: the reason, for FAILED (and "engine stopped" for requests a `stop()` cancelled).
        finish_reason: "eos", "length", "cache_exhausted" (it outgrew the whole KV cache; tokens so far kept),
            "cancelled" or "error".
        warning: set at admission when prompt + max_new_tokens can never fit the KV cache (the request may end
            "cache_exhausted"); None otherwise.
        timings: queued / scheduled / first token / finished marks (perf_counter seconds) with ttft_s, e2e_s.
        prefix_cached_tokens: prompt tokens served from the prefix cache (over the request's life).
        num_offloads: times the request was swapped out to the host pool.
        num_soft_resets: times the request was soft-reset (re-queued, recomputed).
        max_new_tokens: the request's generation limit in tokens (None: unbounded).
        source: who sent the request (e.g. "http 127.0.0.1:53211" for the HTTP server); None for a call from
            Python.
        token_times: when each of `token_ids` was produced (the engine's clock: perf_counter seconds for `Engine`),
            the source of inter-token latencies.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str = ""
    state: RequestState = RequestState.PENDING
    error: str | None = None
    finish_reason: str | None = None
    warning: str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    prefix_cached_tokens: int = 0
    num_offloads: int = 0
    num_soft_resets: int = 0
    max_new_tokens: int | None = None
    source: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.state.is_terminal


@dataclass
class TokenDelta:
    """One streamed increment of a request: the new tokens (and their text) since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    state: RequestState
    finished: bool = False
    error: str | None = None
