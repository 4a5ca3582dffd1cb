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
from typing import Any, Sequence

from .sampling_params import SamplingParams

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
    "TokenLogprob",
]


class RequestState(enum.IntEnum):
    """Request states. Terminal states are >= FINISHED (transformers' convention, plus CANCELLED)."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    def __str__(self) -> str:  # "CANCELLED", not IntEnum's "5", in prints and f-strings
        return self.name

    def __format__(self, spec: str) -> str:  # f"{state:>10}" too (IntEnum formats as the number)
        return format(self.name, spec)

    @property
    def is_terminal(self) -> bool:
        return self >= RequestState.FINISHED


#: Finish reasons of a terminal request: FINISHED ends with "eos", "length", "stop" (a stop string appeared, see
#: `cbnb.engine.stops`) or "cache_exhausted" (it outgrew the whole KV cache, see `cbnb.core.engine_core`); CANCELLED
#: with "cancelled"; FAILED with "error".
CACHE_EXHAUSTED = "cache_exhausted"
FINISH_REASONS = ("eos", "length", "stop", CACHE_EXHAUSTED, "cancelled", "error")

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
        "num_soft_resets", "swapped", "error", "finish_reason", "warning", "text", "user_data", "prompt_text",
        "token_times", "source", "_phase_has_output", "logprobs", "stopper", "streamed", "stop_reason", "dropped",
        "prompt_logprobs", "prompt_logprobs_k",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        max_new_tokens_cap: int | None = None,
        now: float | None = None,
        stopper: Any = None,
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
        self.prompt_text: str | None = None  # the words typed (text prompts and chat messages), for display
        # Per generated token (None: not asked for), see `TokenLogprob`.
        self.logprobs: list[TokenLogprob] | None = [] if self.sampling.logprobs is not None else None
        self.stopper = stopper  # a `cbnb.engine.stops.StopMatcher` when the request has stop strings
        self.streamed = 0  # generated tokens delivered to the request's handle
        self.stop_reason: str | None = None  # the stop string that ended it (finish reason "stop")
        self.dropped = 0  # generated tokens dropped at a stop string (they hold it, or follow it)
        self.source: str | None = source
        # Per prompt token after the first (None: not asked for); k alternatives each. Set by `Engine.submit`.
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs_k: int | None = None

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
    def append_token(self, token: int, now: float | None = None, logprob: "TokenLogprob | None" = None) -> bool:
        """Record a sampled token (consuming one in-flight placeholder if there is one) and its logprob.

        Returns:
            True when the request is now complete (EOS produced, a stop string appeared, or max_new_tokens
            reached). EOS is included in `output_ids`, as in transformers; on a stop string, `output_ids` keep the
            tokens that lie entirely before it and `text` ends right before it (see `cbnb.engine.stops`).
        """
        if self.pending_samples > 0:
            self.pending_samples -= 1
        self.output_ids.append(int(token))
        t = time.perf_counter() if now is None else now
        self.token_times.append(t)
        if self.logprobs is not None:
            self.logprobs.append(logprob if logprob is not None else TokenLogprob(int(token), float("nan")))
        if self.timings.first_token is None:
            self.timings.first_token = t
        if self.stopper is not None and self.stopper.push(int(token)):
            keep = self.stopper.kept_tokens
            self.dropped = len(self.output_ids) - keep
            del self.output_ids[keep:]
            del self.token_times[keep:]
            if self.logprobs is not None:
                del self.logprobs[keep:]
            self.text = self.stopper.text
            self.stop_reason = self.stopper.stop
            self.finish_reason = "stop"
            return True
        if not self.sampling.ignore_eos and token in self.sampling.eos_token_ids:
            self.finish_reason = "eos"
            return True
        if self.max_new_tokens is not None and len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    @property
    def stream_limit(self) -> int:
        """Generated tokens that may be streamed now: all of them, or with stop strings those that cannot be part
        of one (`cbnb.engine.stops.StopMatcher.safe_tokens`)."""
        return len(self.output_ids) if self.stopper is None else min(len(self.output_ids),
                                                                     self.stopper.safe_tokens)

    def decode_text(self, tokenizer: Any) -> str:
        """Fill `text` from `output_ids` (once; a stop string's text is already set) and return it."""
        if tokenizer is not None and not self.text and self.finish_reason != "stop":
            self.text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return self.text

    def add_prompt_logprobs(self, items: list[tuple[int, "TokenLogprob"]]) -> None:
        """Record (position, logprob of the prompt token at that position) pairs from a prefill chunk, in order; a
        position already recorded (a recomputation after a soft reset) is skipped."""
        if self.prompt_logprobs is None:
            return
        for pos, lp in items:
            if pos == len(self.prompt_logprobs) + 1:
                self.prompt_logprobs.append(lp)

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
            prompt_text=self.prompt_text,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stop_reason=self.stop_reason,
            processors=tuple(self.sampling.describe()),
            generated_tokens=len(self.output_ids) + self.dropped,
            source=self.source,
            token_times=list(self.token_times),
            prompt_logprobs=None if self.prompt_logprobs is None else [None, *self.prompt_logprobs],
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
        finish_reason: "eos", "length", "stop" (a stop string appeared: `stop_reason` names it), "cache_exhausted"
            (it outgrew the whole KV cache; tokens so far kept), "cancelled" or "error".
        warning: set at admission when prompt + max_new_tokens can never fit the KV cache (the request may end
            "cache_exhausted"); None otherwise.
        timings: queued / scheduled / first token / finished marks (perf_counter seconds) with ttft_s, e2e_s.
        prefix_cached_tokens: prompt tokens served from the prefix cache at its latest admission (a re-admission
            after a soft reset or a reconfigure counts afresh, never summed; at most the prompt's length).
        num_offloads: times the request was swapped out to the host pool.
        num_soft_resets: times the request was soft-reset (re-queued, recomputed).
        max_new_tokens: the request's generation limit in tokens (None: unbounded).
        prompt_text: the prompt as typed (a text prompt, or the last user message of chat messages; whitespace
            collapsed, at most 200 characters), None for token ids.
        logprobs: one `TokenLogprob` per generated token when asked for (`logprobs=k` or
            `ContinuousBatchingConfig.return_logprobs`), else None.
        stop_reason: the stop string that ended the request (finish reason "stop"), else None.
        processors: what the request applies to its logits, in order (`SamplingParams.describe`).
        generated_tokens: tokens the engine generated: ``len(token_ids)``, plus on a stop string the tokens dropped
            because they hold it (what an API bills as completion tokens).
        source: who sent the request (e.g. "http 127.0.0.1:53211" for the HTTP server); None for a call from
            Python.
        token_times: when each of `token_ids` was produced (the engine's clock: perf_counter seconds for `Engine`),
            the source of inter-token latencies.
        prompt_logprobs: with ``submit(prompt_logprobs=k)``: one entry per prompt token, None for the first (nothing
            predicts it), then each token's `TokenLogprob` under the model's raw distribution (``log_softmax`` of
            the logits at the position before it, no processors) with its k most likely alternatives; filled as
            the prefill runs (complete once the first token is out). None when not asked for.
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
    prompt_text: str | None = None
    logprobs: list["TokenLogprob"] | None = None
    stop_reason: str | None = None
    processors: tuple[str, ...] = ()
    generated_tokens: int = 0
    source: str | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_logprobs: list["TokenLogprob | None"] | None = None

    @property
    def finished(self) -> bool:
        return self.state.is_terminal


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the processed distribution (after the request's logits
    processors and warpers, i.e. ``log_softmax`` of transformers' processed scores), natural log.

    Attributes:
        token_id: the generated token.
        logprob: its log-probability (<= 0).
        top: the k most likely tokens of that distribution as (token id, logprob), most likely first (k = the
            request's `logprobs`; tokens the processors ruled out are not listed, so there may be fewer).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenDelta:
    """One streamed increment of a request: the new tokens (and their text) since the previous delta, with their
    `TokenLogprob`s when the request asked for logprobs (else None)."""

    request_id: str
    token_ids: list[int]
    text: str
    state: RequestState
    finished: bool = False
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
