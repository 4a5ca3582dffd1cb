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

Trace files: `read_trace` / `write_trace` (JSONL or CSV: ``arrival_s``, ``prompt_tokens`` or ``prompt``,
``output_tokens``, and what a row shares: ``prefix`` / ``prefix_tokens`` or ``hash_ids``) live in `cbnb.lab.traces`,
which documents the format; they are re-exported here.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any, Iterable

from .traces import TraceError, TraceRow, read_trace, write_trace  # re-exported: the trace format

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
