"""The `submit` keywords, declared once: name, default, annotation, range, doc, and what a simulation does with each
(torch-free).

`cbnb.Engine.submit` and `cbnb.sim.SimEngine.submit` take their signature from here (`signature`, which help() and
`inspect.signature` show), bind their arguments with it (`bind`: defaults filled, Python's errors for an unknown or
repeated keyword), and declare their `submit_keywords` from it (`engine_keywords`, `simulated_keywords`); the Args
section of `Engine.submit`'s docstring is `args_doc()`; the UI's submit box reads its fields' ranges (`FIELDS`). A
new sampling knob is one `SubmitField` here (and its check in `cbnb.core.sampling_params`).

`FIELDS` maps each name to its `SubmitField`, in signature order; `ARRIVAL_S` is the simulator's own keyword. The
ranges here are what the docs and forms say; the checks that raise (naming the field) live with the data:
`cbnb.core.sampling_params.SamplingParams`, `cbnb.engine.prompts`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["SubmitField", "FIELDS", "ARRIVAL_S", "signature", "bind", "args_doc", "engine_keywords",
           "simulated_keywords"]

_POS, _KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY


@dataclass(frozen=True)
class SubmitField:
    """One `submit` keyword.

    Attributes:
        name, annotation (as help() shows it), default.
        positional: may be passed by position (the first ones, in order).
        lo, hi: its numeric range, for forms (None: unbounded or not a number).
        sim: what a `SimEngine` does with it: "honoured" (listed in its `submit_keywords`), "ignored" (validated
            or accepted, then ignored, and not listed: the server refuses it for a simulation), "refused" (a
            `ValueError`: it needs logits or text).
    """

    name: str
    annotation: str
    default: Any = None
    positional: bool = False
    lo: float | None = None
    hi: float | None = None
    sim: str = "honoured"


def _f(name: str, annotation: str, **kw: Any) -> SubmitField:
    return SubmitField(name, annotation, **kw)


_ORDER = (
    _f("prompt", "Any", default=inspect.Parameter.empty, positional=True),
    _f("max_new_tokens", "int | None", positional=True, lo=1),
    _f("do_sample", "bool | None", positional=True),
    _f("temperature", "float | None", positional=True, lo=0.0),
    _f("top_k", "int | None", positional=True, lo=0),
    _f("top_p", "float | None", positional=True, lo=0.0, hi=1.0),
    _f("seed", "int | None", positional=True),
    _f("eos_token_id", "int | Sequence[int] | None", positional=True),
    _f("request_id", "str | None", positional=True),
    _f("ignore_eos", "bool | None"),
    _f("chat", "bool | None"),
    _f("source", "str | None"),
    _f("min_p", "float | None", lo=0.0, hi=1.0),
    _f("min_new_tokens", "int | None", lo=0),
    _f("min_length", "int | None", lo=0),
    _f("repetition_penalty", "float | None", lo=0.0),
    _f("frequency_penalty", "float | None", lo=-2.0, hi=2.0),
    _f("presence_penalty", "float | None", lo=-2.0, hi=2.0),
    _f("no_repeat_ngram_size", "int | None", lo=0),
    _f("bad_words_ids", "Sequence[Sequence[int]] | None"),
    _f("sequence_bias", "Any"),
    _f("logit_bias", "dict[int, float] | None"),
    _f("suppress_tokens", "Sequence[int] | None"),
    _f("begin_suppress_tokens", "Sequence[int] | None"),
    _f("forced_bos_token_id", "int | None"),
    _f("forced_eos_token_id", "int | Sequence[int] | None"),
    _f("stop", "str | Sequence[str] | None", sim="refused"),
    _f("logprobs", "int | None", lo=0, hi=20, sim="refused"),
    _f("prompt_logprobs", "int | None", lo=0, hi=20, sim="refused"),
    _f("response_format", "dict | None", sim="ignored"),
    _f("json_schema", "Any", sim="ignored"),
)
FIELDS: dict[str, SubmitField] = {f.name: f for f in _ORDER}
#: `SimEngine.submit`'s own keyword: when the request reaches the engine (simulated seconds).
ARRIVAL_S = _f("arrival_s", "float | None", lo=0.0)

# The Args section of `Engine.submit` (fields named together share an entry), in the docstring's order.
_ARGS_DOC = (
    ("prompt", "text, chat messages, token ids or a tokenizer output (see `encode`)."),
    ("max_new_tokens", "tokens to generate at most; None: up to the model's max positions."),
    ("do_sample, temperature, top_k, top_p, min_p, seed", "sampling (greedy by default; a temperature of 0\n"
     "or below 1e-5 is greedy; top_k=0 is no top-k)."),
    ("eos_token_id", "stop id(s); None: the generation config's, else the model's EOS."),
    ("request_id", 'a unique id (default: "req-N").'),
    ("ignore_eos", "never stop on EOS (benchmarks)."),
    ("chat", "apply the chat template to a text prompt (None: when the tokenizer has one)."),
    ("source", "who sent it (free text, at most `cbnb.core.requests.MAX_SOURCE_CHARS` characters), carried on the\n"
     "request's outputs and shown on the dashboard's board; the HTTP server passes \"http <host:port>\".\n"
     "None: a call from Python."),
    ("min_new_tokens, min_length, repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias,\n"
     "suppress_tokens, begin_suppress_tokens, forced_bos_token_id, forced_eos_token_id",
     "transformers'\nlogits processors (GenerationConfig's names and ranges)."),
    ("frequency_penalty, presence_penalty", "OpenAI's penalties in [-2, 2], over the generated tokens."),
    ("logit_bias", "OpenAI's {token id: bias in [-100, 100]}, added to the logits."),
    ("stop", "stop string(s): generation ends when one appears; the output text ends before it (needs a\n"
     "tokenizer; see `cbnb.engine.stops`)."),
    ("logprobs", "0..20: each token's logprob and that many most likely alternatives (`TokenLogprob`, in the\n"
     "output and in every streamed delta); None: only when `config.return_logprobs` (then 0)."),
    ("prompt_logprobs", "0..20: every prompt token's logprob under the model's raw distribution (no processors)\n"
     "and that many alternatives, in `RequestOutput.prompt_logprobs` (None for the first token). Such a\n"
     "request bypasses the prefix cache (a cached position has no logits), so it computes its whole\n"
     "prompt; the CPU runner only (the CUDA runner refuses it)."),
    ("response_format, json_schema", "structured output (`cbnb.engine.structured`): OpenAI's ``response_format``\n"
     "(``{\"type\": \"json_object\"}`` or ``{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}``), or a\n"
     "JSON schema (dict, JSON text or pydantic model class); every token is masked by the grammar."),
)


def _parameters(fields: tuple[SubmitField, ...]) -> list[inspect.Parameter]:
    return [inspect.Parameter(f.name, _POS if f.positional else _KW, default=f.default, annotation=f.annotation)
            for f in fields]


_ENGINE_SIG = inspect.Signature(_parameters(_ORDER))
_SIM_SIG = inspect.Signature(_parameters(_ORDER + (ARRIVAL_S,)))
_DEFAULTS = {f.name: f.default for f in _ORDER[1:]}
_SIM_DEFAULTS = {**_DEFAULTS, ARRIVAL_S.name: None}
_KEYWORDS, _SIM_KEYWORDS = frozenset(_DEFAULTS), frozenset(_SIM_DEFAULTS)
_POSITIONAL = tuple(f.name for f in _ORDER[1:] if f.positional)


def signature(*, simulated: bool = False, returns: str = "RequestHandle") -> inspect.Signature:
    """`submit`'s signature as a method (``self`` first), for ``__signature__``; `simulated` adds `arrival_s`."""
    sig = _SIM_SIG if simulated else _ENGINE_SIG
    params = [inspect.Parameter("self", _POS), *sig.parameters.values()]
    return inspect.Signature(params, return_annotation=returns)


def bind(prompt: Any, args: tuple, kwargs: dict[str, Any], *, simulated: bool = False) -> dict[str, Any]:
    """Every keyword's value for one call (defaults filled in), ``prompt`` included.

    Raises:
        TypeError: an unknown keyword, a keyword given twice, or too many positional arguments (Python's words).
    """
    defaults = _SIM_DEFAULTS if simulated else _DEFAULTS
    if args and len(args) <= len(_POSITIONAL) and kwargs.keys().isdisjoint(_POSITIONAL[:len(args)]):
        kwargs = {**dict(zip(_POSITIONAL, args)), **kwargs}  # (a positional max_new_tokens, without inspect)
        args = ()
    if args or not kwargs.keys() <= (_SIM_KEYWORDS if simulated else _KEYWORDS):
        try:
            kwargs = (_SIM_SIG if simulated else _ENGINE_SIG).bind(prompt, *args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"submit() {e}") from None
    out = dict(defaults)  # (the common case, keywords only, needs no inspect)
    out.update(kwargs)
    out["prompt"] = prompt
    return out


def args_doc(indent: int = 12) -> str:
    """The Args section's entries of `Engine.submit` (each entry's continuation lines indented 4 more)."""
    pad, more = " " * indent, " " * (indent + 4)
    lines = []
    for names, text in _ARGS_DOC:
        first, *rest = f"{names}: {text}".split("\n")
        lines.append(pad + first)
        lines.extend(more + r for r in rest)
    return "\n".join(lines)


def engine_keywords() -> frozenset[str]:
    """The keywords `cbnb.Engine.submit` honours: all of them."""
    return frozenset(FIELDS)


def simulated_keywords() -> frozenset[str]:
    """The keywords a `SimEngine` honours (`arrival_s` and the "honoured" ones; what needs logits or text, and what
    it accepts but ignores, are not listed)."""
    return frozenset(f.name for f in _ORDER if f.sim == "honoured") | {ARRIVAL_S.name}
