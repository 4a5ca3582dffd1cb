"""`SamplingParams`: how one request turns logits into tokens, validated field by field (torch-free).

A request's logits go through, in this order (transformers' `_get_logits_processor` order, plus the OpenAI
penalties after the repetition penalty, as vLLM applies them):

1. logits processors, for greedy and sampled requests alike, over the request's full history (prompt + generated):
   `sequence_bias` and `logit_bias` (added; a multi-token sequence only when the history ends with its prefix),
   `repetition_penalty` (transformers: a logit x of a token already in the history becomes x / p if x > 0, else
   x * p), `frequency_penalty` / `presence_penalty` (OpenAI: x - c * frequency - (c > 0) * presence, with c the
   token's count among the *generated* tokens), `no_repeat_ngram_size` (a token that would repeat an n-gram of the
   history is banned), `bad_words_ids` (banned; a multi-token word only when the history ends with its prefix; a
   word that is a request's EOS id alone is ignored, as in transformers), `min_length` (EOS banned while prompt +
   generated < min_length), `min_new_tokens` (EOS banned while generated < min_new_tokens), `forced_bos_token_id`
   (the only candidate when the history is one token), `forced_eos_token_id` (the only candidates for the last token
   allowed by `max_new_tokens`), `suppress_tokens` (always banned), `begin_suppress_tokens` (banned for the first
   generated token; the second when the prompt is one token and `forced_bos_token_id` is set);
2. warpers, only when sampling: temperature, top-k, top-p, min-p (a token is kept when its probability is at least
   `min_p` times the most likely token's);
3. the draw: the argmax (greedy), or a sample from the softmax (see `cbnb.runner.sampling`).

A request samples when `do_sample` is True and its temperature is at least `GREEDY_TEMPERATURE` (1e-5): below that,
dividing fp32 logits by the temperature overflows to inf, so it is greedy, as in vLLM (``_SAMPLING_EPS``).

`logprobs` (0 to `MAX_LOGPROBS`): each generated token's log-probability under the processed distribution (after
processors and warpers: ``log_softmax`` of what `model.generate(output_scores=True)` returns as scores), and, for
logprobs = k > 0, the k most likely tokens of that distribution with theirs (OpenAI's ``top_logprobs``).

`stop`: strings that end the request once they appear in the generated text (see `cbnb.engine.stops`).

`grammar`: structured output (`cbnb.engine.structured.CompiledGrammar`, built by `Engine.submit` from `response_format`
/ `json_schema`): after the processors, every token the grammar does not allow at that point is -inf (greedy and
sampled rows alike; see `cbnb.runner.grammar`).

Every bad value raises `ValueError` naming the field and its allowed range; `check_vocab` checks token ids against a
vocabulary once it is known.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Iterable

__all__ = ["SamplingParams", "GREEDY_TEMPERATURE", "MAX_LOGPROBS", "PROCESSOR_FIELDS"]

#: Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5
#: The largest `logprobs` (top-k alternatives per token), as OpenAI's ``top_logprobs``.
MAX_LOGPROBS = 20
#: Logits-processor fields with their neutral value (the value that applies nothing).
PROCESSOR_FIELDS: dict[str, Any] = {
    "sequence_bias": (), "logit_bias": (), "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "no_repeat_ngram_size": 0, "bad_words_ids": (), "min_length": 0, "min_new_tokens": 0,
    "forced_bos_token_id": None, "forced_eos_token_id": (), "suppress_tokens": (), "begin_suppress_tokens": (),
}
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


def _fail(name: str, allowed: str, v: Any) -> None:
    raise ValueError(f"{name} must be {allowed}; got {v!r}")


def _int(name: str, v: Any, lo: int, note: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        _fail(name, f"an integer >= {lo}" + (f" ({note})" if note else ""), v)
    return int(v)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _id(name: str, v: Any) -> int:
    try:
        i = operator.index(v) if not isinstance(v, bool) else -1
    except TypeError:
        i = -1
    if i < 0:
        _fail(name, "made of token ids (integers >= 0)", v)
    return int(i)


def _ids(name: str, v: Any, *, allow_one: bool = False) -> tuple[int, ...]:
    if v is None:
        return ()
    if allow_one and not isinstance(v, (list, tuple)):
        return (_id(name, v),)
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        _fail(name, "a list of token ids", v)
    return tuple(_id(name, i) for i in v)


def _sequences(name: str, v: Any) -> tuple[tuple[int, ...], ...]:
    if v is None:
        return ()
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        _fail(name, "a list of lists of token ids", v)
    out = []
    for s in v:
        if isinstance(s, (str, bytes)) or not isinstance(s, Iterable):
            _fail(name, "a list of lists of token ids", v)
        t = tuple(_id(name, i) for i in s)
        if not t:
            _fail(name, "a list of non-empty lists of token ids", v)
        out.append(t)
    return tuple(out)


def _bias_value(name: str, b: Any, bound: float | None = None) -> float:
    if not _num(b) or math.isnan(b) or b == math.inf or (bound is not None and not -bound <= b <= bound):
        _fail(name, f"biases in [-{bound:g}, {bound:g}]" if bound else "biases that are numbers (-inf allowed, "
              "not +inf or NaN)", b)
    return float(b)


def _sequence_bias(v: Any) -> tuple[tuple[tuple[int, ...], float], ...]:
    """transformers' forms: {(ids...): bias} or [[[ids...], bias], ...]."""
    if v is None:
        return ()
    name = "sequence_bias"
    items = v.items() if isinstance(v, dict) else v
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        _fail(name, "a dict {(token ids): bias} or a list [[token ids, bias], ...]", v)
    out: dict[tuple[int, ...], float] = {}
    for item in items:
        try:
            seq, b = item
        except (TypeError, ValueError):
            _fail(name, "a dict {(token ids): bias} or a list [[token ids, bias], ...]", v)
        ids = _ids(name, seq, allow_one=True)
        if not ids:
            _fail(name, "non-empty token id sequences", v)
        out[ids] = _bias_value(name, b)
    return tuple(out.items())


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's form: {token id: bias in [-100, 100]} (string keys of JSON accepted when they are integers)."""
    if v is None:
        return ()
    if isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in v):
        v = dict(v)  # the normalised form
    if not isinstance(v, dict):
        _fail("logit_bias", "a dict {token id: bias}", v)
    out = {}
    for k, b in v.items():
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        out[_id("logit_bias", k)] = _bias_value("logit_bias", b, _MAX_LOGIT_BIAS)
    return tuple(sorted(out.items()))


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if isinstance(items, (bytes, dict)) or not isinstance(items, Iterable):
        _fail("stop", "a string or a list of strings", v)
    out = tuple(items)
    if any(not isinstance(s, str) or not s for s in out):
        _fail("stop", "a string or a list of non-empty strings", v)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (the module docstring gives the order and the formulas).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1), or None: bounded by the model's max positions.
        do_sample: False -> greedy (argmax of the processed logits); True -> sample (see `greedy`).
        temperature: >= 0; applied before top-k/top-p/min-p when sampling; below `GREEDY_TEMPERATURE` (0 included)
            means greedy.
        top_k: keep the k most likely tokens (>= 1), or 0 / None for no top-k (0 is stored as None).
        top_p: nucleus mass in (0, 1], or None for no top-p.
        min_p: in [0, 1], or None: keep tokens with probability >= min_p * the top token's.
        seed: per-request RNG seed (an int), or None for the engine's RNG.
        eos_token_ids: token ids that end the request (the EOS token is included in the output). Negative ids are
            ignored, as in transformers (-1 means "no EOS").
        ignore_eos: never stop on EOS (benchmarks).
        sequence_bias: ((token ids), bias) pairs, transformers' `sequence_bias`.
        logit_bias: (token id, bias) pairs, OpenAI's `logit_bias` (biases in [-100, 100]).
        repetition_penalty: > 0 (1.0: off). frequency_penalty, presence_penalty: in [-2, 2] (0: off).
        no_repeat_ngram_size: >= 0 (0: off). bad_words_ids: banned token sequences.
        min_length: >= 0, prompt + generated tokens before EOS is allowed. min_new_tokens: >= 0, generated ones.
        forced_bos_token_id: a token id or None. forced_eos_token_id: token ids (empty: off).
        suppress_tokens, begin_suppress_tokens: token ids.
        stop: stop strings. logprobs: None, or 0..`MAX_LOGPROBS` alternatives per token.
        grammar: None, or a compiled grammar (an object with ``matcher()``: `cbnb.engine.structured.CompiledGrammar`).

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
    min_p: float | None = None
    sequence_bias: Any = ()
    logit_bias: Any = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: Any = ()
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: Any = ()
    suppress_tokens: Any = ()
    begin_suppress_tokens: Any = ()
    stop: Any = ()
    logprobs: int | None = None
    grammar: Any = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.max_new_tokens is not None:
            _int("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.do_sample, bool):
            _fail("do_sample", "True or False", self.do_sample)
        t = self.temperature
        if not _num(t) or not (t >= 0) or t == math.inf:
            _fail("temperature", "a finite number >= 0 (below 1e-5, 0 included: greedy)", t)
        if self.top_k is not None:
            if _int("top_k", self.top_k, 0, "0 or None: no top-k") == 0:
                put(self, "top_k", None)
        p = self.top_p
        if p is not None and (not _num(p) or not (0 < p <= 1)):
            _fail("top_p", "a number in (0, 1] or None", p)
        m = self.min_p
        if m is not None and (not _num(m) or not (0 <= m <= 1)):
            _fail("min_p", "a number in [0, 1] or None", m)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            _fail("seed", "an integer or None", self.seed)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "True or False", self.ignore_eos)
        put(self, "eos_token_ids", self.normalize_eos(self.eos_token_ids, "eos_token_ids"))
        r = self.repetition_penalty
        if not _num(r) or not (0 < r < math.inf):
            _fail("repetition_penalty", "a finite number > 0 (1.0: off)", r)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _num(v) or not (-2 <= v <= 2):
                _fail(name, "a number in [-2, 2] (0: off)", v)
        for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
            _int(name, getattr(self, name), 0)
        if self.forced_bos_token_id is not None:
            put(self, "forced_bos_token_id", _id("forced_bos_token_id", self.forced_bos_token_id))
        put(self, "forced_eos_token_id", _ids("forced_eos_token_id", self.forced_eos_token_id, allow_one=True))
        put(self, "sequence_bias", _sequence_bias(self.sequence_bias))
        put(self, "logit_bias", _logit_bias(self.logit_bias))
        put(self, "bad_words_ids", _sequences("bad_words_ids", self.bad_words_ids))
        put(self, "suppress_tokens", _ids("suppress_tokens", self.suppress_tokens))
        put(self, "begin_suppress_tokens", _ids("begin_suppress_tokens", self.begin_suppress_tokens))
        put(self, "stop", _stops(self.stop))
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] (top alternatives per token) or None",
                  self.logprobs)
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            _fail("grammar", "None or a compiled grammar (cbnb.engine.structured.request_grammar)", self.grammar)

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

    # ------------------------------------------------------------------------------------------ derived
    # (cached: the sampler reads them for every row of every step)
    @cached_property
    def greedy(self) -> bool:
        """True when the request takes the argmax: not `do_sample`, or a temperature below `GREEDY_TEMPERATURE`."""
        return not self.do_sample or self.temperature < GREEDY_TEMPERATURE

    @cached_property
    def processors(self) -> tuple[str, ...]:
        """Names of the logits processors this request applies, in order."""
        return tuple(n for n, neutral in PROCESSOR_FIELDS.items() if getattr(self, n) != neutral)

    @cached_property
    def needs_history(self) -> bool:
        """Whether a processor reads the request's token history (not just its length)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.no_repeat_ngram_size > 0 or any(len(s) > 1 for s in self.bad_words_ids)
                or any(len(s) > 1 for s, _ in self.sequence_bias))

    @cached_property
    def plain(self) -> bool:
        """Greedy with no processor, no grammar and no logprobs: the argmax of the raw logits is the token."""
        return self.greedy and self.logprobs is None and not self.processors and self.grammar is None

    def describe(self) -> list[str]:
        """What this request applies, in order, as short "name=value" strings (telemetry: the board, events)."""
        return list(self._description)

    @cached_property
    def _description(self) -> tuple[str, ...]:
        out = []
        for name in self.processors:
            v = getattr(self, name)
            out.append(f"{name}={v:g}" if isinstance(v, float) else
                       f"{name}={v}" if isinstance(v, int) else f"{name}({len(v)})")
        if self.greedy:
            out.append("greedy" if not self.do_sample else f"greedy (temperature {self.temperature:g} < "
                       f"{GREEDY_TEMPERATURE:g})")
        else:
            out.append(f"temperature={self.temperature:g}" if self.temperature != 1.0 else "sample")
            for name in ("top_k", "top_p", "min_p"):
                v = getattr(self, name)
                if v is not None and v not in (1.0,) and not (name == "min_p" and v == 0):
                    out.append(f"{name}={v:g}")
            if self.seed is not None:
                out.append(f"seed={self.seed}")
        if self.logprobs is not None:
            out.append(f"logprobs={self.logprobs}")
        if self.stop:
            out.append(f"stop({len(self.stop)})")
        if self.grammar is not None:
            out.append(self.grammar.describe())
        return tuple(out)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `ValueError` naming the field when a token id lies outside ``[0, vocab_size)``, or when `logprobs`
        asks for more alternatives than the vocabulary has."""
        def bad(name: str, ids: Iterable[int]) -> None:
            for i in ids:
                if i >= vocab_size:
                    raise ValueError(f"{name}: token id {i} is outside the vocabulary [0, {vocab_size})")

        bad("logit_bias", (i for i, _ in self.logit_bias))
        bad("sequence_bias", (i for s, _ in self.sequence_bias for i in s))
        bad("bad_words_ids", (i for s in self.bad_words_ids for i in s))
        for name in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
            bad(name, getattr(self, name))
        if self.forced_bos_token_id is not None:
            bad("forced_bos_token_id", [self.forced_bos_token_id])
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size ({vocab_size}); got {self.logprobs}")


#: Every field name of `SamplingParams`.
FIELDS = tuple(f.name for f in fields(SamplingParams))
