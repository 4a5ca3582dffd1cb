"""Traffic: when requests arrive and how long they are (torch-free, deterministic under a seed).

Arrival processes give each request an arrival time in seconds from the start of a run:

=====================  ===========================================================================================
`Offline()`            every request at 0 (today's offline workloads)
`Poisson(rate)`        exponential inter-arrival gaps, mean ``1 / rate`` (requests per second); cv of the gaps = 1
`Gamma(rate, cv)`      gamma inter-arrival gaps with mean ``1 / rate`` and coefficient of variation ``cv``
                       (shape ``k = 1 / cv**2``, scale ``1 / (rate * k)``); ``cv > 1`` is bursty, ``cv = 1`` is
                       Poisson. vLLM's ``bench serve --burstiness`` is this shape ``k``.
=====================  ===========================================================================================

The first request arrives at 0 and gap *i* separates requests *i - 1* and *i*, so *n* requests span *n - 1* gaps
(the rate estimate is ``(n - 1) / arrival_s[-1]``).

Length distributions give token counts (integers >= 1):

=========================  ========================================================================================
`Fixed(n)`                 always ``n``
`Uniform(lo, hi)`          integers in ``[lo, hi]``, both included
`LogNormal(mean, sigma)`   ``round(x)`` with ``ln x ~ Normal(mu, sigma)`` and ``mu = ln(mean) - sigma**2 / 2``, so
                           that ``E[x] = mean``; clipped to ``[lo, hi]`` (default ``[1, inf)``)
`Empirical(values)`        resampled with replacement from observed lengths (e.g. a trace's column)
=========================  ========================================================================================

Every generator takes a `random.Random`, so the same seed gives the same numbers on every machine (Python's
`random` algorithms are fixed across platforms). `spec()` describes a generator as a JSON-able dict, and
`from_spec` rebuilds it (the run log stores specs).

Trace files (`read_trace`): one request per JSONL line or CSV row, with the fields

=================  ========  =================================================================================
field              required  meaning
=================  ========  =================================================================================
``arrival_s``      yes       seconds from the start (a number >= 0; rows need not be sorted)
``prompt_tokens``  one of    prompt length in tokens (an integer >= 1): the prompt is random token ids
``prompt``         these     the prompt text (tokenised by the engine, or by `workloads.from_trace`'s tokenizer)
``output_tokens``  yes       tokens to generate (an integer >= 1; EOS is ignored)
=================  ========  =================================================================================

CSV files have a header row naming the columns (any order; extra columns are ignored). JSONL lines are objects;
blank lines and lines starting with ``#`` are skipped. A bad row raises `TraceError` naming the file, the line
(1-based, the CSV header is line 1) and the column.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = [
    "Offline", "Poisson", "Gamma", "Fixed", "Uniform", "LogNormal", "Empirical", "from_spec",
    "TraceRow", "TraceError", "read_trace", "write_trace", "ARRIVALS", "LENGTHS",
]


def _positive(name: str, v: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v >= 0 if allow_zero else v > 0) and (not integer or float(v).is_integer())
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {'>= 0' if allow_zero else '> 0'}; got {v!r}")


# ---------------------------------------------------------------------------------------------------- arrivals
@dataclass(frozen=True)
class Offline:
    """Every request arrives at 0."""

    def times(self, n: int, rng: random.Random) -> list[float]:
        return [0.0] * n

    def spec(self) -> dict[str, Any]:
        return {"kind": "offline"}

    def __str__(self) -> str:
        return "offline"


@dataclass(frozen=True)
class Poisson:
    """Poisson arrivals at `rate` requests per second (exponential gaps)."""

    rate: float

    def __post_init__(self) -> None:
        _positive("Poisson.rate (requests/s)", self.rate)

    def times(self, n: int, rng: random.Random) -> list[float]:
        return _accumulate(rng.expovariate(self.rate) for _ in range(max(0, n - 1)))

    def spec(self) -> dict[str, Any]:
        return {"kind": "poisson", "rate": self.rate}

    def __str__(self) -> str:
        return f"Poisson {self.rate:g} req/s"


@dataclass(frozen=True)
class Gamma:
    """Bursty arrivals: gamma gaps with mean ``1 / rate`` seconds and coefficient of variation `cv`."""

    rate: float
    cv: float

    def __post_init__(self) -> None:
        _positive("Gamma.rate (requests/s)", self.rate)
        _positive("Gamma.cv", self.cv)

    @property
    def shape(self) -> float:
        """Gamma shape k = 1 / cv**2 (vLLM's "burstiness")."""
        return 1.0 / (self.cv * self.cv)

    def times(self, n: int, rng: random.Random) -> list[float]:
        k = self.shape
        theta = 1.0 / (self.rate * k)
        return _accumulate(rng.gammavariate(k, theta) for _ in range(max(0, n - 1)))

    def spec(self) -> dict[str, Any]:
        return {"kind": "gamma", "rate": self.rate, "cv": self.cv}

    def __str__(self) -> str:
        return f"gamma {self.rate:g} req/s, cv {self.cv:g}"


def _accumulate(gaps: Iterable[float]) -> list[float]:
    t, out = 0.0, [0.0]
    for g in gaps:
        t += g
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------------- lengths
@dataclass(frozen=True)
class Fixed:
    """Always `n` tokens."""

    n: int

    def __post_init__(self) -> None:
        _positive("Fixed.n (tokens)", self.n, integer=True)

    def sample(self, count: int, rng: random.Random) -> list[int]:
        return [int(self.n)] * count

    def scaled(self, scale: float) -> "Fixed":
        return Fixed(max(1, round(self.n * scale)))

    def spec(self) -> dict[str, Any]:
        return {"kind": "fixed", "n": self.n}


@dataclass(frozen=True)
class Uniform:
    """Integers uniform in [lo, hi] (both included)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _positive("Uniform.lo (tokens)", self.lo, integer=True)
        _positive("Uniform.hi (tokens)", self.hi, integer=True)
        if self.hi < self.lo:
            raise ValueError(f"Uniform.hi must be >= Uniform.lo; got lo={self.lo}, hi={self.hi}")

    def sample(self, count: int, rng: random.Random) -> list[int]:
        return [rng.randint(self.lo, self.hi) for _ in range(count)]

    def scaled(self, scale: float) -> "Uniform":
        lo = max(1, round(self.lo * scale))
        return Uniform(lo, max(lo, round(self.hi * scale)))

    def spec(self) -> dict[str, Any]:
        return {"kind": "uniform", "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class LogNormal:
    """Lognormal lengths with mean `mean` tokens and log-space standard deviation `sigma`, clipped to [lo, hi]."""

    mean: float
    sigma: float
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        _positive("LogNormal.mean (tokens)", self.mean)
        _positive("LogNormal.sigma", self.sigma, allow_zero=True)
        _positive("LogNormal.lo (tokens)", self.lo, integer=True)
        if self.hi is not None:
            _positive("LogNormal.hi (tokens)", self.hi, integer=True)
            if self.hi < self.lo:
                raise ValueError(f"LogNormal.hi must be >= LogNormal.lo; got lo={self.lo}, hi={self.hi}")

    @property
    def mu(self) -> float:
        """Mean of ln(x): ln(mean) - sigma**2 / 2."""
        return math.log(self.mean) - self.sigma ** 2 / 2

    def sample_real(self, count: int, rng: random.Random) -> list[float]:
        """Unrounded, unclipped draws (what `sample` rounds and clips)."""
        return [rng.lognormvariate(self.mu, self.sigma) for _ in range(count)]

    def sample(self, count: int, rng: random.Random) -> list[int]:
        hi = self.hi if self.hi is not None else math.inf
        return [int(min(hi, max(self.lo, round(x)))) for x in self.sample_real(count, rng)]

    def scaled(self, scale: float) -> "LogNormal":
        lo = max(1, round(self.lo * scale))
        hi = None if self.hi is None else max(lo, round(self.hi * scale))
        return LogNormal(max(1.0, self.mean * scale), self.sigma, lo, hi)

    def spec(self) -> dict[str, Any]:
        return {"kind": "lognormal", "mean": self.mean, "sigma": self.sigma, "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class Empirical:
    """Lengths resampled with replacement from `values` (token counts >= 1)."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        vals = tuple(self.values)
        if not vals:
            raise ValueError("Empirical.values must not be empty")
        for v in vals:
            _positive("Empirical.values[i] (tokens)", v, integer=True)
        object.__setattr__(self, "values", tuple(int(v) for v in vals))

    def sample(self, count: int, rng: random.Random) -> list[int]:
        return [rng.choice(self.values) for _ in range(count)]

    def scaled(self, scale: float) -> "Empirical":
        return Empirical(tuple(max(1, round(v * scale)) for v in self.values))

    def spec(self) -> dict[str, Any]:
        return {"kind": "empirical", "values": list(self.values)}

    @classmethod
    def from_trace(cls, path: str | os.PathLike, column: str = "output_tokens") -> "Empirical":
        """The lengths of one column of a trace ("prompt_tokens" or "output_tokens")."""
        if column not in ("prompt_tokens", "output_tokens"):
            raise ValueError(f"column must be 'prompt_tokens' or 'output_tokens'; got {column!r}")
        vals = [getattr(r, column) for r in read_trace(path)]
        vals = [v for v in vals if v is not None]
        if not vals:
            raise ValueError(f"{path}: no row has {column}")
        return cls(tuple(vals))


ARRIVALS = {"offline": Offline, "poisson": Poisson, "gamma": Gamma}
LENGTHS = {"fixed": Fixed, "uniform": Uniform, "lognormal": LogNormal, "empirical": Empirical}


def from_spec(spec: dict[str, Any]) -> Any:
    """Rebuild an arrival process or a length distribution from its `spec()`.

    Raises:
        ValueError: unknown kind or bad parameters.
    """
    kind = spec.get("kind")
    cls = ARRIVALS.get(kind) or LENGTHS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"spec kind must be one of {', '.join([*ARRIVALS, *LENGTHS])}; got {kind!r}")
    kw = {k: v for k, v in spec.items() if k != "kind"}
    if cls is Empirical:
        kw["values"] = tuple(kw["values"])
    return cls(**kw)


# ---------------------------------------------------------------------------------------------------- traces
class TraceError(ValueError):
    """A bad row in a trace file; `path`, `line` (1-based) and `column` say where."""

    def __init__(self, path: str, line: int, column: str | None, message: str) -> None:
        self.path, self.line, self.column = path, line, column
        where = f"{path}, line {line}" + (f", column {column!r}" if column else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: arrival time (s), prompt length or text, output tokens."""

    arrival_s: float
    output_tokens: int
    prompt_tokens: int | None = None
    prompt: str | None = None


_FIELDS = ("arrival_s", "prompt_tokens", "prompt", "output_tokens")


def _number(raw: Any, path: str, line: int, col: str, *, integer: bool) -> float | int:
    if isinstance(raw, bool) or raw is None or (isinstance(raw, str) and not raw.strip()):
        raise TraceError(path, line, col, f"must be {'an integer >= 1' if integer else 'a number >= 0'}; "
                                          f"got {raw!r}")
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise TraceError(path, line, col, f"must be {'an integer' if integer else 'a number'}; got {raw!r}") from None
    if not math.isfinite(v):
        raise TraceError(path, line, col, f"must be finite; got {raw!r}")
    if integer:
        if not v.is_integer() or v < 1:
            raise TraceError(path, line, col, f"must be an integer >= 1; got {raw!r}")
        return int(v)
    if v < 0:
        raise TraceError(path, line, col, f"must be >= 0 seconds; got {raw!r}")
    return v


def _row(rec: dict[str, Any], path: str, line: int) -> TraceRow:
    for col in ("arrival_s", "output_tokens"):
        if col not in rec or rec[col] is None or rec[col] == "":
            raise TraceError(path, line, col, "is missing (required)")
    arrival = _number(rec["arrival_s"], path, line, "arrival_s", integer=False)
    out = _number(rec["output_tokens"], path, line, "output_tokens", integer=True)
    has_len = rec.get("prompt_tokens") not in (None, "")
    has_text = rec.get("prompt") not in (None, "")
    if has_len == has_text:
        raise TraceError(path, line, "prompt_tokens" if not has_len else "prompt",
                         "give exactly one of prompt_tokens (a length) or prompt (text)")
    if has_text:
        if not isinstance(rec["prompt"], str):
            raise TraceError(path, line, "prompt", f"must be text; got {type(rec['prompt']).__name__}")
        return TraceRow(float(arrival), int(out), prompt=rec["prompt"])
    n = _number(rec["prompt_tokens"], path, line, "prompt_tokens", integer=True)
    return TraceRow(float(arrival), int(out), prompt_tokens=int(n))


def read_trace(path: str | os.PathLike, fmt: str | None = None) -> list[TraceRow]:
    """Read a JSONL or CSV trace (format from the extension, or `fmt` = "jsonl" / "csv"), in file order.

    Raises:
        TraceError: a bad row (file, 1-based line, column and what is wrong) or an empty trace.
        ValueError: an unknown format.
    """
    p = os.fspath(path)
    kind = fmt or ("csv" if p.lower().endswith(".csv") else "jsonl" if p.lower().endswith((".jsonl", ".json"))
                   else None)
    if kind not in ("csv", "jsonl"):
        raise ValueError(f"trace format must be 'jsonl' or 'csv' (from the file extension or fmt=); got {p!r}")
    rows: list[TraceRow] = []
    with open(p, newline="", encoding="utf-8") as f:
        if kind == "csv":
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            for col in ("arrival_s", "output_tokens"):
                if col not in header:
                    raise TraceError(p, 1, col, f"the header has no {col!r} column (columns: {', '.join(header)})")
            if "prompt_tokens" not in header and "prompt" not in header:
                raise TraceError(p, 1, "prompt_tokens", "the header needs a 'prompt_tokens' or a 'prompt' column")
            for rec in reader:
                if None in rec:  # more cells than header columns
                    raise TraceError(p, reader.line_num, None,
                                     f"{len(header) + len(rec[None])} cells but the header has {len(header)}")
                rows.append(_row(rec, p, reader.line_num))
        else:
            for i, text in enumerate(f, start=1):
                s = text.strip()
                if not s or s.startswith("#"):
                    continue
                try:
                    rec = json.loads(s)
                except json.JSONDecodeError as e:
                    raise TraceError(p, i, None, f"not valid JSON ({e.msg} at character {e.colno})") from None
                if not isinstance(rec, dict):
                    raise TraceError(p, i, None, f"must be a JSON object; got {type(rec).__name__}")
                rows.append(_row(rec, p, i))
    if not rows:
        raise TraceError(p, 1, None, "the trace has no requests")
    return rows


def write_trace(path: str | os.PathLike, rows: Sequence[TraceRow]) -> None:
    """Write rows as JSONL (``.jsonl``) or CSV (``.csv``) in the format `read_trace` reads."""
    p = os.fspath(path)
    recs = [{k: getattr(r, k) for k in _FIELDS if getattr(r, k) is not None} for r in rows]
    with open(p, "w", newline="", encoding="utf-8") as f:
        if p.lower().endswith(".csv"):
            w = csv.DictWriter(f, fieldnames=list(_FIELDS))
            w.writeheader()
            for r in recs:
                w.writerow(r)
        else:
            for r in recs:
                f.write(json.dumps(r) + "\n")
