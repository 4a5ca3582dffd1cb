"""Standard workloads (the design's table): deterministic prompts of random token ids, EOS ignored, greedy.

=================  ========  ==============================  ===================  ================  ==========
name               requests  prompt tokens                   new tokens           model             where
=================  ========  ==============================  ===================  ================  ==========
``cpu-32``         32        U[32, 256]                      32                   smollm2-135m fp32 CPU
``shared-prefix``  64        512 common + U[16, 64] own      32                   smollm2-135m      CPU, GPU
``long-gen``       16        U[16, 64]                       512 (small cache)    smollm2-135m      CPU
``cpu-poisson``    64        lognormal(128, 0.5) in [16,512] lognormal(32, 0.5)   smollm2-135m      CPU
                             Poisson arrivals at CPU_POISSON_RATE (~70 % of this machine's capacity)
``chat-burst``     64        half: 256-token system prompt   lognormal(32, 0.5)   smollm2-135m      CPU, sim
                             + lognormal(64, 0.6) own; gamma arrivals, cv 3, at CPU_POISSON_RATE
``nanovllm-256``   256       U[100, 1024]                    U[100, 1024]         shape:qwen3-0.6b  GPU
=================  ========  ==============================  ===================  ================  ==========

Every workload has per-request arrival times (`Workload.arrival_s`, seconds from the start of a run): all 0 for the
offline ones (``cpu-32``, ``shared-prefix``, ``long-gen``, ``nanovllm-256``, unchanged from before arrivals
existed), drawn from `cbnb.lab.traffic` processes for ``cpu-poisson`` and ``chat-burst``. `with_arrivals` re-times any
workload (same prompts, new arrivals), `synthetic` builds one from an arrival process and two length distributions,
and `from_trace` from a JSONL/CSV trace file (`cbnb.lab.traffic.read_trace` documents the format).

`scale` shrinks a workload for CI and notebooks: request counts and token counts are multiplied by it (at least 1
request, 1 new token and 4 prompt tokens), keeping the shape of the distribution. Arrival rates are not scaled
(a scaled-down Poisson workload is a lighter load). Token ids are drawn from ``[FIRST_ID, vocab_size)`` so that
special tokens (low ids in SmolLM2 and Gemma) are avoided; `vocab_size` is the workload model's unless
``get_workload(name, engine=e)`` is given the engine, whose vocabulary it then fits (a Qwen3-sized id fails
every request on a Llama-sized vocabulary).

How ``CPU_POISSON_RATE`` was derived: the cpu-poisson requests were run offline (all at 0, on a fresh cache: the
capacity measurement `cbnb.lab.tuning.measure_capacity` makes) with the workload's config hints on this machine
(2 cores, float32, 2 torch threads), 5 times. The capacity is the finished requests per second of such a run
(the engine never idles), and the rate is 70 % of it (utilisation = arrival rate / service capacity). The 5 runs
gave 0.17-2.34 requests/s because the 2 cores were shared with other jobs (load average 6-7); contention only
lowers a run's rate, so the machine's own capacity is the fastest run, 2.34 requests/s (it also matches the
arithmetic: ~9,000 prompt tokens at ~700 tok/s plus ~2,100 decode tokens at ~150 tok/s take ~27 s), and the rate is
0.7 x 2.34 = 1.6 requests/s. Under heavy contention two torch threads collapse (each OpenMP thread waits for the
other whenever one loses its core: 0.12-0.17 requests/s, against 0.9-1.4 with one thread in the same minutes), so on
a shared machine set ``OMP_NUM_THREADS=1`` and measure the capacity where you run (notebook 02 does). The figures are
in `CPU_POISSON_CALIBRATION`. On another machine, measure its
capacity and re-time: ``with_arrivals(wl, Poisson(0.7 * measure_capacity(engine, wl)["capacity_requests_per_s"]))``
(its median; take the max of more repeats on a shared machine).
"""

from __future__ import annotations

import math
import os
import random
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from . import traffic as tr

__all__ = ["Workload", "WORKLOADS", "get_workload", "FIRST_ID", "synthetic", "with_arrivals", "from_trace",
           "trace_rows", "CPU_POISSON_RATE", "CPU_POISSON_CALIBRATION"]

FIRST_ID = 32

#: Poisson rate of ``cpu-poisson`` (requests/s): 70 % of the capacity measured on this machine (see the module doc).
CPU_POISSON_RATE = 1.6
#: The measurement behind `CPU_POISSON_RATE` (2026-12-01, 2 cores shared with other jobs: load average 6-7).
CPU_POISSON_CALIBRATION: dict[str, Any] = {
    "load": 0.7, "capacity_requests_per_s": 2.34, "estimator": "max over runs (contention only lowers it)",
    "runs_requests_per_s": [0.533, 0.506, 2.338, 1.112, 0.166], "median_requests_per_s": 0.533,
    "config": {"page_size": 32, "num_blocks": 128, "max_batch_tokens": 256}, "threads": 2,
    "command": "scripts/calibrate_cpu_poisson.py --repeats 5 --load 0.7", "date": "2026-12-01",
    # Later the same day, load average 5-9: 2 threads 0.12-0.17 requests/s, 1 thread 0.89-1.36 (--threads 1).
    "contended_runs": {"threads_2": [0.123, 0.170, 0.144], "threads_1": [1.362, 0.895, 0.934]},
}


@dataclass(frozen=True)
class Workload:
    """A list of requests plus the model and config hints they are meant for.

    Attributes:
        name: workload name.
        model: the model name `cbnb.load_model` takes.
        prompts: token ids per request (or text, from a trace without a tokenizer: the engine tokenises it).
        max_new_tokens: per request (EOS is ignored, so exactly this many are generated).
        config_hints: `ContinuousBatchingConfig` fields the workload is designed around (e.g. a small num_blocks).
        dtype: the dtype the workload is specified for.
        arrival_s: per request, seconds from the start of a run at which it is submitted (empty: all 0).
        traffic: how the arrivals and lengths were made (JSON-able specs, seed, scale), for the run log.

    Raises:
        ValueError: lengths of prompts / max_new_tokens / arrival_s differ, or an arrival time is negative or not
            finite.
    """

    name: str
    model: str
    prompts: list[Any]
    max_new_tokens: list[int]
    config_hints: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    description: str = ""
    arrival_s: list[float] = field(default_factory=list)
    traffic: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.max_new_tokens) != n:
            raise ValueError(f"max_new_tokens has {len(self.max_new_tokens)} entries for {n} prompts")
        if not self.arrival_s:
            object.__setattr__(self, "arrival_s", [0.0] * n)
        elif len(self.arrival_s) != n:
            raise ValueError(f"arrival_s has {len(self.arrival_s)} entries for {n} prompts")
        for i, t in enumerate(self.arrival_s):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"arrival_s[{i}] must be a finite number of seconds >= 0; got {t!r}")
        if not self.traffic:
            object.__setattr__(self, "traffic", {"arrivals": tr.Offline().spec()} if not any(self.arrival_s)
                               else {"arrivals": {"kind": "explicit"}})

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def offline(self) -> bool:
        """True when every request arrives at 0."""
        return not any(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """The last arrival time (seconds)."""
        return max(self.arrival_s, default=0.0)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the token-id prompts (text prompts count once tokenised, so not here)."""
        return sum(len(p) for p in self.prompts if not isinstance(p, str))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)


def _n(x: float, scale: float, lo: int = 1) -> int:
    return max(lo, int(round(x * scale)))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def _cpu32(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(32, scale)
    prompts = [_ids(rng, _n(rng.randint(32, 256), scale, 4), vocab) for _ in range(n)]
    return Workload("cpu-32", "smollm2-135m", prompts, [_n(32, scale)] * n,
                    {"page_size": 256, "num_blocks": 80, "max_batch_tokens": 512},
                    description="32 prompts of U[32,256] tokens, 32 new tokens each, on CPU")


def _shared(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(64, scale)
    common = _ids(rng, _n(512, scale, 4), vocab)
    prompts = [common + _ids(rng, _n(rng.randint(16, 64), scale), vocab) for _ in range(n)]
    return Workload("shared-prefix", "smollm2-135m", prompts, [_n(32, scale)] * n,
                    {"page_size": 16, "max_batch_tokens": 512},
                    description="64 prompts sharing a 512-token system prompt, 32 new tokens each")


def _longgen(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(16, scale)
    prompts = [_ids(rng, _n(rng.randint(16, 64), scale, 4), vocab) for _ in range(n)]
    gen = _n(512, scale)
    # A cache for about a quarter of the final tokens, so requests must be offloaded or soft-reset, but never
    # smaller than two of the longest requests (one must always fit whole, or it would fail instead).
    total = sum(len(p) + gen for p in prompts)
    page = 16
    longest = max(len(p) for p in prompts) + gen
    blocks = max(total // (4 * page), 2 * -(-longest // page))
    return Workload("long-gen", "smollm2-135m", prompts, [gen] * n,
                    {"page_size": page, "num_blocks": blocks, "max_batch_tokens": 256},
                    description="16 short prompts generating 512 tokens each in a cache too small for all")


def _nanovllm(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(256, scale)
    prompts = [_ids(rng, _n(rng.randint(100, 1024), scale, 4), vocab) for _ in range(n)]
    gens = [_n(rng.randint(100, 1024), scale) for _ in range(n)]
    return Workload("nanovllm-256", "shape:qwen3-0.6b", prompts, gens, {}, dtype="bfloat16",
                    description="nano-vllm's benchmark: 256 requests, random ids, U[100,1024] in and out")


def _check_arrivals(arrivals: Any) -> None:
    """An arrival process has ``times`` and ``spec``; a bare number is refused with the fix (its unit is ambiguous:
    a rate or a gap)."""
    if isinstance(arrivals, (int, float)) and not isinstance(arrivals, bool):
        raise TypeError(f"arrivals must be an arrival process (cbnb.lab.traffic.Offline(), Poisson(rate), Gamma(rate, "
                        f"cv)); got the number {arrivals!r}: for {arrivals!r} requests/s pass Poisson({arrivals!r})")
    if not (hasattr(arrivals, "times") and hasattr(arrivals, "spec")):
        raise TypeError(f"arrivals must be an arrival process (cbnb.lab.traffic.Offline(), Poisson(rate), Gamma(rate, "
                        f"cv)); got {type(arrivals).__name__}")


def _check_lengths(name: str, dist: Any) -> None:
    if isinstance(dist, int) and not isinstance(dist, bool):
        raise TypeError(f"{name} must be a length distribution (cbnb.lab.traffic.Fixed, Uniform, LogNormal, "
                        f"Empirical); got the number {dist!r}: for always {dist!r} tokens pass Fixed({dist!r})")
    if not (hasattr(dist, "sample") and hasattr(dist, "spec") and hasattr(dist, "scaled")):
        raise TypeError(f"{name} must be a length distribution (cbnb.lab.traffic.Fixed, Uniform, LogNormal, "
                        f"Empirical); got {type(dist).__name__}")


def synthetic(name: str, n: int, arrivals: Any, prompt_len: Any, output_len: Any, *, model: str = "smollm2-135m",
              vocab_size: int = 49152, seed: int = 0, shared_prefix_tokens: int = 0,
              shared_fraction: float | None = None, config_hints: dict[str, Any] | None = None,
              description: str = "", scale: float = 1.0) -> Workload:
    """A workload of `n` random-id requests with arrival times and lengths from `cbnb.lab.traffic` generators.

    Args:
        arrivals: an arrival process (`Offline()`, `Poisson(rate)`, `Gamma(rate, cv)`). A bare number is refused
            (TypeError): pass ``Poisson(20.0)`` for 20 requests/s.
        prompt_len, output_len: length distributions (`Fixed`, `Uniform`, `LogNormal`, `Empirical`); prompt lengths
            exclude the shared prefix.
        shared_prefix_tokens: length of a common system prompt put in front of `shared_fraction` of the requests
            (which ones: a seeded draw).
        shared_fraction: the share of requests with the shared prefix, in [0, 1]. None (the default): every request
            when `shared_prefix_tokens` > 0, none otherwise. A prefix with ``shared_fraction=0``, or a fraction > 0
            without a prefix, shares nothing and warns.
        scale: applied to `n`, the lengths and the shared prefix (not to the arrival rate).

    The prompts, the lengths and the arrivals come from three seeded streams, so re-timing a workload
    (`with_arrivals`) or changing the arrival rate leaves the prompts as they were.

    Raises:
        ValueError: n < 1, a shared_fraction outside [0, 1], a negative shared_prefix_tokens, or a vocabulary too
            small.
        TypeError: `arrivals` is not an arrival process or a length is not a distribution (the message says
            what to pass).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1; got {n!r}")
    _check_arrivals(arrivals)
    _check_lengths("prompt_len", prompt_len)
    _check_lengths("output_len", output_len)
    if not isinstance(shared_prefix_tokens, int) or isinstance(shared_prefix_tokens, bool) or shared_prefix_tokens < 0:
        raise ValueError(f"shared_prefix_tokens must be an integer >= 0; got {shared_prefix_tokens!r}")
    if shared_fraction is None:
        shared_fraction = 1.0 if shared_prefix_tokens else 0.0
    elif not (isinstance(shared_fraction, (int, float)) and 0.0 <= shared_fraction <= 1.0):
        raise ValueError(f"shared_fraction must be in [0, 1]; got {shared_fraction!r}")
    elif shared_prefix_tokens and shared_fraction == 0:
        warnings.warn(f"synthetic({name!r}): shared_prefix_tokens={shared_prefix_tokens} with shared_fraction=0 "
                      "puts the prefix in front of no request; leave shared_fraction unset to share it with all",
                      UserWarning, stacklevel=2)
    elif not shared_prefix_tokens and shared_fraction > 0:
        warnings.warn(f"synthetic({name!r}): shared_fraction={shared_fraction} without shared_prefix_tokens shares "
                      "nothing; set shared_prefix_tokens", UserWarning, stacklevel=2)
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}; got {vocab_size}")
    if scale != 1.0:
        n = _n(n, scale)
        prompt_len, output_len = prompt_len.scaled(scale), output_len.scaled(scale)
        shared_prefix_tokens = _n(shared_prefix_tokens, scale, 4) if shared_prefix_tokens else 0
    ids_rng = random.Random(f"{name}:{seed}:ids")
    len_rng = random.Random(f"{name}:{seed}:lengths")
    p_lens = prompt_len.sample(n, len_rng)
    o_lens = output_len.sample(n, len_rng)
    common = _ids(ids_rng, shared_prefix_tokens, vocab_size) if shared_prefix_tokens else []
    shared = set(ids_rng.sample(range(n), round(shared_fraction * n))) if common else set()
    prompts = [(common if i in shared else []) + _ids(ids_rng, p_lens[i], vocab_size) for i in range(n)]
    times = arrivals.times(n, random.Random(f"{name}:{seed}:arrivals"))
    traffic = {"arrivals": arrivals.spec(), "prompt_len": prompt_len.spec(), "output_len": output_len.spec(),
               "shared_prefix_tokens": shared_prefix_tokens, "shared_requests": len(shared), "seed": seed,
               "scale": scale}
    return Workload(name, model, prompts, o_lens, dict(config_hints or {}), description=description,
                    arrival_s=times, traffic=traffic)


def with_arrivals(workload: Workload, arrivals: Any, *, seed: int | None = None, name: str | None = None) -> Workload:
    """The same requests with arrival times from `arrivals` (e.g. ``Poisson(2.0)``, or ``Offline()``).

    `seed` defaults to the workload's own seed, so the same process gives the same times.
    """
    _check_arrivals(arrivals)
    s = workload.traffic.get("seed", 0) if seed is None else seed
    times = arrivals.times(workload.num_requests, random.Random(f"{workload.name}:{s}:arrivals"))
    traffic = dict(workload.traffic, arrivals=arrivals.spec(), seed=s)
    return replace(workload, name=name or workload.name, arrival_s=times, traffic=traffic)


def from_trace(path: str | os.PathLike | Sequence[tr.TraceRow], *, name: str | None = None,
               model: str = "smollm2-135m", vocab_size: int = 49152, seed: int = 0, tokenizer: Any = None,
               config_hints: dict[str, Any] | None = None, block_size: int = 512) -> Workload:
    """A workload from a JSONL/CSV trace (`cbnb.lab.traffic.read_trace`), or from its rows: one request per row, in
    order.

    Rows with ``prompt_tokens`` get that many seeded random ids; rows with ``prompt`` text are tokenised with
    `tokenizer` when given (``tokenizer(text)["input_ids"]``), else kept as text for the engine to tokenise.

    Sharing becomes equal ids: a row of ``prefix`` group *g* starts with the first ``prefix_tokens`` ids of *g*'s
    own seeded sequence (one per group, drawn once, as long as the group's longest prefix); a row with ``hash_ids``
    is the concatenation of one seeded block of ``block_size`` ids per hash id (the same id gives the same block,
    wherever it appears), cut to ``prompt_tokens``, and padded with the row's own random ids when the hash ids cover
    fewer tokens. `block_size` applies to rows without their own (512: Mooncake's).

    Raises:
        cbnb.lab.traffic.TraceError: a bad row (file, line, column).
    """
    if isinstance(path, (str, os.PathLike)):
        rows = tr.read_trace(path, block_size=block_size)
        src = os.fspath(path)
    else:
        rows = list(path)
        src = name or "rows"
        if not rows:
            raise ValueError("from_trace: no rows")
    rng = random.Random(f"trace:{seed}")
    groups: dict[str, list[int]] = {}
    glen: dict[str, int] = {}
    for r in rows:
        if r.prefix is not None:
            glen[r.prefix] = max(glen.get(r.prefix, 0), int(r.prefix_tokens or 0))
    for g in sorted(glen):
        groups[g] = _ids(random.Random(f"trace:{seed}:prefix:{g}"), glen[g], vocab_size)
    blocks: dict[tuple[int, int], list[int]] = {}
    prompts: list[Any] = []
    for r in rows:
        if r.prompt is not None:
            prompts.append(list(tokenizer(r.prompt)["input_ids"]) if tokenizer is not None else r.prompt)
            continue
        n = int(r.prompt_tokens)
        if r.hash_ids:
            bs = int(r.block_size or block_size)
            ids: list[int] = []
            for h in r.hash_ids:
                if len(ids) >= n:
                    break
                key = (h, bs)
                if key not in blocks:
                    blocks[key] = _ids(random.Random(f"trace:{seed}:block:{bs}:{h}"), bs, vocab_size)
                ids.extend(blocks[key])
            ids = ids[:n]
        elif r.prefix is not None:
            ids = groups[r.prefix][: int(r.prefix_tokens)]
        else:
            ids = []
        prompts.append(ids + _ids(rng, n - len(ids), vocab_size))
    nm = name or os.path.splitext(os.path.basename(src))[0]
    shared = sum(1 for r in rows if r.prefix is not None or r.hash_ids)
    traffic = {"arrivals": {"kind": "trace", "path": src}, "seed": seed, "shared_requests": shared}
    return Workload(nm, model, prompts, [r.output_tokens for r in rows], dict(config_hints or {}),
                    description=f"trace {src} ({len(rows)} requests)",
                    arrival_s=[r.arrival_s for r in rows], traffic=traffic)


def trace_rows(workload: Workload, *, block_size: int = 16) -> list[tr.TraceRow]:
    """The workload as trace rows (`cbnb.lab.traffic.write_trace` writes them) that keep its prefix sharing.

    Each row has ``prompt_tokens`` and ``hash_ids``: one id per full `block_size`-token block of its prompt, a
    chain over the block's ids and every block before it (as a prefix cache hashes pages), so two prompts get the
    same id at position *j* exactly when their first ``(j + 1) * block_size`` tokens are equal; a partial last
    block gets an id of its own. Read back (`from_trace`), shared leading blocks are equal ids again, so the prefix
    hits are the same on any ``page_size`` that is a multiple of `block_size` (the ids themselves are new).

    Raises:
        ValueError: a text prompt (no token ids to compare), or block_size < 1.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
    ids_of: dict[tuple, int] = {}
    rows = []
    for i, (p, n, t) in enumerate(zip(workload.prompts, workload.max_new_tokens, workload.arrival_s)):
        if isinstance(p, str):
            raise ValueError(f"trace_rows: prompt {i} is text; only token-id prompts can be written with sharing")
        p = list(p)
        hs, prev = [], None
        for j in range(0, len(p), block_size):
            blk = tuple(p[j:j + block_size])
            key = (prev, blk) if len(blk) == block_size else ("partial", i, j)
            if key not in ids_of:
                ids_of[key] = len(ids_of)
            prev = ids_of[key]
            hs.append(prev)
        rows.append(tr.TraceRow(float(t), int(n), prompt_tokens=len(p), hash_ids=tuple(hs), block_size=block_size))
    return rows


def _cpu_poisson(vocab: int, scale: float, seed: int, rate: float | None) -> Workload:
    return synthetic("cpu-poisson", 64, tr.Poisson(rate or CPU_POISSON_RATE), tr.LogNormal(128, 0.5, 16, 512),
                     tr.LogNormal(32, 0.5, 4, 128), vocab_size=vocab, seed=seed, scale=scale,
                     config_hints={"page_size": 32, "num_blocks": 128, "max_batch_tokens": 256},
                     description="64 requests, Poisson arrivals at ~70 % of this machine's capacity, "
                                 "lognormal prompt and output lengths")


def _chat_burst(vocab: int, scale: float, seed: int, rate: float | None) -> Workload:
    return synthetic("chat-burst", 64, tr.Gamma(rate or CPU_POISSON_RATE, 3.0), tr.LogNormal(64, 0.6, 8, 256),
                     tr.LogNormal(32, 0.5, 4, 128), vocab_size=vocab, seed=seed, scale=scale,
                     shared_prefix_tokens=256, shared_fraction=0.5,
                     config_hints={"page_size": 16, "num_blocks": 256, "max_batch_tokens": 256},
                     description="64 chat requests in bursts (gamma arrivals, cv 3); half share a 256-token "
                                 "system prompt")


_BUILDERS = {"cpu-32": _cpu32, "shared-prefix": _shared, "long-gen": _longgen, "nanovllm-256": _nanovllm}
_TIMED = {"cpu-poisson": _cpu_poisson, "chat-burst": _chat_burst}
WORKLOADS: tuple[str, ...] = ("cpu-32", "shared-prefix", "long-gen", "cpu-poisson", "chat-burst", "nanovllm-256")
_MODEL = {"cpu-32": "smollm2-135m", "shared-prefix": "smollm2-135m", "long-gen": "smollm2-135m",
          "cpu-poisson": "smollm2-135m", "chat-burst": "smollm2-135m", "nanovllm-256": "shape:qwen3-0.6b"}
_DEFAULT_VOCAB = {"smollm2-135m": 49152, "shape:qwen3-0.6b": 151936}


def get_workload(name: str, *, vocab_size: int | None = None, seed: int = 0, scale: float = 1.0,
                 rate: float | None = None, engine: Any = None) -> Workload:
    """Build a standard workload.

    Args:
        name: one of `WORKLOADS`.
        vocab_size: ids are drawn below it (default: the engine's vocabulary when `engine` is given, else the
            workload model's).
        engine: the engine the workload will run on (`cbnb.Engine`, `cbnb.sim.SimEngine`: anything with a
            ``vocab_size``): token ids are drawn within its vocabulary, so that e.g. nanovllm-256 (specified on
            Qwen3's 151,936 ids) runs on a 128,256-id Llama instead of failing every request at submit.
        seed: RNG seed (the same seed gives the same workload).
        scale: multiply request and token counts (0 < scale <= 1 shrinks it for CI/notebooks).
        rate: arrival rate in requests/s for the timed workloads (cpu-poisson, chat-burst; default
            `CPU_POISSON_RATE`); ignored by the offline ones.

    Raises:
        ValueError: unknown name (lists the choices), a non-positive scale or rate, a too small vocabulary, or a
            `vocab_size` larger than the engine's.
    """
    if name not in _MODEL:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    if not (scale > 0):
        raise ValueError(f"scale must be > 0; got {scale!r}")
    if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a number of requests/s > 0; got {rate!r}")
    engine_vocab = getattr(engine, "vocab_size", None) if engine is not None else None
    if engine is not None and not isinstance(engine_vocab, int):
        raise ValueError(f"engine must have an integer vocab_size (cbnb.Engine, SimEngine); got "
                         f"{type(engine).__name__}")
    if vocab_size is not None and engine_vocab is not None and vocab_size > engine_vocab:
        raise ValueError(f"vocab_size must be <= the engine's vocabulary ({engine_vocab}); got {vocab_size}")
    vocab = vocab_size or engine_vocab or _DEFAULT_VOCAB[_MODEL[name]]
    if vocab <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}; got {vocab}")
    if name in _TIMED:
        return _TIMED[name](vocab, scale, seed, rate)
    wl = _BUILDERS[name](random.Random(f"{name}:{seed}"), vocab, scale)
    return replace(wl, traffic={"arrivals": tr.Offline().spec(), "seed": seed, "scale": scale})
