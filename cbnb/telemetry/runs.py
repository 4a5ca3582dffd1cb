"""The run log: every workload run and every reconfigure of an engine, with its config change and figures.

::

    log = run_log(engine)              # engine.runs (a cbnb.Engine makes it in its constructor; another
                                       # engine-like object gets one on first use); survives reconfigure
    log.to_frame()                     # one row per entry (pandas)
    log.summary()                      # one row per (engine, workload, config change): median, min, max
    log.to_json(); RunLog.from_json(text)
    run_log(engine, path="runs.jsonl") # persist: every entry is appended as a JSON line; a restarted notebook
                                       # that opens the same file keeps its history (or: Engine(..., runs=path))

Entries (`Run`) hold: an id, the kind ("run" or "reconfigure"), the engine that ran it ("cbnb", "hf-cb", ...), the
full config (transformers field names), its change against the log's base config (what the Runs panel shows), the
workload (name, request count, arrival and length specs), the figures (`cbnb.lab.metrics.summarize` plus the engine's
KV / offload figures), and optional sweep bookkeeping (sweep id, point, repeat). Per-request records stay in memory
(`Run.records`) and are written to JSON only when asked (``include_records=True``). Torch-free.

It lives in `cbnb.telemetry`, below the engine (which makes one per engine) and the tuning lab (which fills it);
``cbnb.lab.runs`` is the same module under its older name.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["Run", "RunLog", "run_log", "config_dict", "change_text", "spread", "summary_frame", "provenance_text",
           "KEY_FIGURES"]

#: The figures the Runs panel and `best` talk about first (`cbnb.lab.metrics` re-exports them).
KEY_FIGURES: tuple[str, ...] = ("goodput_requests_per_s", "slo_attainment_pct", "ttft_s_p50", "ttft_s_p99",
                                "tpot_s_p50", "tpot_s_p99", "itl_s_p99", "e2e_s_p99", "output_tokens_per_s",
                                "mean_kv_fragmentation_frac", "soft_resets", "recomputed_tokens")


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def config_dict(config: Any) -> dict[str, Any]:
    """A config as a JSON-able dict of its fields (a `ContinuousBatchingConfig`, a dict, or None -> {})."""
    if config is None:
        return {}
    d = dict(config) if isinstance(config, Mapping) else config.to_dict()
    return {k: _jsonable(v) for k, v in d.items()}


def _changes(config: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if base.get(k, object()) != v}


def change_text(changes: Mapping[str, Any]) -> str:
    """``{"page_size": 16}`` -> ``"page_size=16"``; no change -> ``"base"``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(changes.items())) or "base"


@dataclass
class Run:
    """One entry of the run log (see the module doc)."""

    id: int
    kind: str
    engine: str
    config: dict[str, Any]
    changes: dict[str, Any]
    workload: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    sweep: str | None = None
    point: int | None = None
    repeat: int | None = None
    time: float = field(default_factory=time.time)
    note: str = ""
    records: list[Any] = field(default_factory=list, repr=False, compare=False)
    #: where the engine's figures come from: {"kind": "measured"} for a real engine, a simulator profile's
    #: `HardwareProfile.trust()` ("datasheet", "calibrated", "fitted", with its error) for `SimEngine`.
    provenance: dict[str, Any] = field(default_factory=dict)
    #: what the run's figures mean, in words (`cbnb.lab.metrics.DEFINITIONS`: goodput, its steady-state window, SLO).
    definitions: dict[str, str] = field(default_factory=dict)

    @property
    def change(self) -> str:
        return change_text(self.changes)

    def group_key(self) -> tuple:
        """Runs with the same key are repeats of one point: engine, workload (name + arrivals + closed-loop
        concurrency) and config change."""
        wl = self.workload
        return (self.engine, wl.get("name", ""), json.dumps(wl.get("arrivals", {}), sort_keys=True),
                "" if wl.get("max_concurrency") is None else f"concurrency {wl['max_concurrency']}",
                json.dumps(self.changes, sort_keys=True, default=str))

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        d = {k: _jsonable(getattr(self, k)) for k in ("id", "kind", "engine", "config", "changes", "workload",
                                                         "metrics", "label", "sweep", "point", "repeat", "time",
                                                         "note", "provenance", "definitions")}
        if include_records:
            d["records"] = [r.to_dict(tokens=True) if hasattr(r, "to_dict") else _jsonable(r) for r in self.records]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Run":
        kw = {k: d[k] for k in ("id", "kind", "engine", "config", "changes", "workload", "metrics", "label",
                                "sweep", "point", "repeat", "time", "note", "provenance", "definitions") if k in d}
        run = cls(**kw)
        run.records = list(d.get("records", []))
        return run


class RunLog:
    """A thread-safe, append-only list of `Run`s, optionally persisted to a JSON-lines file.

    Args:
        base: the config that `changes` are measured against (default: the first config recorded).
        path: a file to append every entry to (created if missing; existing entries are loaded first).

    The file: a first line ``{"base": {...}}`` (the base config, written when the file is created), then one JSON
    object per entry (`Run.to_dict`). A file that has a base line keeps it: reopened with another `base`, its
    entries and the new ones are still measured against the one config it started with. (A file without that
    line takes `base`, or its first entry's config.)

    Raises:
        ValueError: `path` holds a line that is not a run entry (the message names the line).
    """

    def __init__(self, base: Any = None, path: str | os.PathLike | None = None) -> None:
        self._lock = threading.Lock()
        self._runs: list[Run] = []
        self.base: dict[str, Any] | None = config_dict(base) if base is not None else None
        self.path = os.fspath(path) if path is not None else None
        self.version = 0  # bumped on every change (the Runs panel polls it)
        if self.path and os.path.exists(self.path):
            self._load(self.path)

    def _load(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    if isinstance(d, dict) and set(d) == {"base"} and isinstance(d["base"], dict):
                        self.base = d["base"]
                        continue
                    run = Run.from_dict(d)
                except (json.JSONDecodeError, TypeError, KeyError) as e:
                    raise ValueError(f"{path}, line {i}: not a run-log entry ({e})") from None
                self._runs.append(run)
        if self._runs and self.base is None:
            first = self._runs[0]
            self.base = {k: v for k, v in first.config.items()}
        self.version += 1

    # ------------------------------------------------------------------------------------------ recording
    def _next_id(self) -> int:
        return (self._runs[-1].id + 1) if self._runs else 1

    def add(self, kind: str, *, engine: str = "cbnb", config: Any = None, workload: Mapping[str, Any] | None = None,
            metrics: Mapping[str, Any] | None = None, records: Iterable[Any] = (), **extra: Any) -> Run:
        """Append an entry; `config` is a config object or dict (its change vs `base` is computed here)."""
        cfg = config_dict(config)
        with self._lock:
            if self.base is None:
                self.base = dict(cfg)
            run = Run(self._next_id(), kind, engine, cfg, _changes(cfg, self.base), dict(workload or {}),
                      {k: _jsonable(v) for k, v in (metrics or {}).items()}, records=list(records), **extra)
            self._runs.append(run)
            self.version += 1
            if self.path:
                fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
                with open(self.path, "a", encoding="utf-8") as f:
                    if fresh:
                        f.write(json.dumps({"base": self.base}) + "\n")
                    f.write(json.dumps(run.to_dict()) + "\n")
        return run

    def record_reconfigure(self, old: Any, new: Any, *, engine: str = "cbnb", note: str = "") -> Run:
        """Record that the engine switched from config `old` to `new` (`note`: by default what changed, or
        "same config (fresh cache)")."""
        delta = _changes(config_dict(new), config_dict(old))
        return self.add("reconfigure", engine=engine, config=new,
                        note=note or (change_text(delta) if delta else "same config (fresh cache)"))

    # ------------------------------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self):
        return iter(list(self._runs))

    def __getitem__(self, i: int) -> Run:
        return self._runs[i]

    def get(self, run_id: int) -> Run:
        """The entry with this id.

        Raises:
            KeyError: no such id.
        """
        for r in self._runs:
            if r.id == run_id:
                return r
        raise KeyError(f"no run with id {run_id} (ids: {[r.id for r in self._runs][:20]})")

    def runs(self, kind: str | None = "run") -> list[Run]:
        """Entries of one kind ("run", "reconfigure"; None: all)."""
        return [r for r in self._runs if kind is None or r.kind == kind]

    def to_frame(self, kind: str | None = None):
        """One row per entry: id, kind, engine, change, workload, label, sweep, point, repeat, then the metrics.

        Raises:
            ImportError: without pandas.
        """
        import pandas as pd

        rows = []
        for r in self.runs(kind):
            rows.append({"id": r.id, "kind": r.kind, "engine": r.engine, "change": r.change,
                         "workload": r.workload.get("name", ""), "label": r.label, "sweep": r.sweep,
                         "point": r.point, "repeat": r.repeat, **r.changes, **r.metrics})
        return pd.DataFrame(rows)

    def groups(self, runs: Iterable[Run] | None = None) -> list[list[Run]]:
        """Runs grouped by `Run.group_key` (first-seen order)."""
        out: dict[tuple, list[Run]] = {}
        for r in (self.runs("run") if runs is None else runs):
            out.setdefault(r.group_key(), []).append(r)
        return list(out.values())

    def summary(self, figures: Iterable[str] | None = None, runs: Iterable[Run] | None = None):
        """One row per group of repeats: engine, workload, change, n, then ``<figure>_median/_min/_max``.

        Raises:
            ImportError: without pandas.
        """
        return summary_frame(self.groups(runs), figures)

    def to_json(self, include_records: bool = False) -> str:
        """The whole log as JSON: {"base": config, "runs": [entries]}."""
        return json.dumps({"base": self.base, "runs": [r.to_dict(include_records) for r in self._runs]})

    @classmethod
    def from_json(cls, text: str) -> "RunLog":
        d = json.loads(text)
        log = cls(base=d.get("base"))
        log._runs = [Run.from_dict(x) for x in d.get("runs", [])]
        log.version += 1
        return log

    def save(self, path: str | os.PathLike, include_records: bool = False) -> None:
        """Write the log as JSON lines (the format `RunLog(path=...)` loads: the base line, then the entries)."""
        with open(path, "w", encoding="utf-8") as f:
            if self.base is not None:
                f.write(json.dumps({"base": self.base}) + "\n")
            for r in self._runs:
                f.write(json.dumps(r.to_dict(include_records)) + "\n")

    def __repr__(self) -> str:
        n = len(self.runs("run"))
        return f"RunLog({n} runs, {len(self._runs) - n} reconfigures{', ' + self.path if self.path else ''})"


def summary_frame(groups: Iterable[list[Run]], figures: Iterable[str] | None = None,
                  changes: Iterable[Mapping[str, Any]] | None = None):
    """One row per group: engine, workload, change, n, ids, the change's fields, ``<figure>_median/_min/_max``.

    `changes` names each group (default: its first run's change against the log's base).
    """
    import pandas as pd

    figs = list(figures or KEY_FIGURES)
    groups = list(groups)
    names = list(changes) if changes is not None else [g[0].changes for g in groups]
    rows = []
    for g, ch in zip(groups, names):
        row: dict[str, Any] = {"engine": g[0].engine, "workload": g[0].workload.get("name", ""),
                               "change": change_text(ch), "n": len(g), "ids": [r.id for r in g], **ch}
        if g[0].provenance and g[0].provenance.get("kind") != "measured":
            row["prediction"] = provenance_text(g[0].provenance)
        for f in figs:
            s = spread([r.metrics.get(f) for r in g])
            row.update({f"{f}_median": s[0], f"{f}_min": s[1], f"{f}_max": s[2]})
        rows.append(row)
    return pd.DataFrame(rows)


def provenance_text(prov: Mapping[str, Any]) -> str:
    """A short label of a run's provenance, its error band included: "measured", "datasheet: unverified",
    "fitted to public vLLM points: ±5.6 % on 6 held-out public points", "fitted from 3 runs (±2.1 % leave-one-out)",
    "calibrated on this CPU (±15.1 %)", "calibrated at smollm2-135m (float32), not this model: unverified"."""
    kind = prov.get("kind", "")
    err = prov.get("loo_error_pct") if prov.get("loo_error_pct") is not None else prov.get("error_pct")
    details = prov.get("details") or {}
    if kind == "datasheet":
        return "datasheet: unverified"
    if kind == "fitted":
        if not isinstance(err, (int, float)):
            return f"fitted from {prov.get('runs')} runs (error unknown)"
        if details.get("public"):
            return f"fitted to public vLLM points: ±{err:.1f} % on {prov.get('runs')} held-out public points"
        return f"fitted from {prov.get('runs')} runs (±{err:.1f} % leave-one-out)"
    if kind == "calibrated":
        if details.get("other_model"):
            return f"calibrated at {details['other_model']}, not this model: unverified"
        return f"calibrated on this CPU (±{err:.1f} %)" if isinstance(err, (int, float)) else "calibrated on this CPU"
    if kind == "custom":
        return "custom profile (unverified)"
    return str(kind)


def spread(values: Iterable[Any]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the numeric values (None entries ignored); (None, None, None) when there are none."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not xs:
        return (None, None, None)
    return (statistics.median(xs), min(xs), max(xs))


def run_log(engine: Any, path: str | os.PathLike | None = None) -> RunLog:
    """The engine's run log (``engine.runs``). `cbnb.Engine` creates it in its constructor (``Engine(...,
    runs="runs.jsonl")`` persists it from the start); for another engine-like object it is created here on first
    use, with the engine's config as the base, and set as its ``runs`` attribute.

    With `path`, the log is (re)attached to that file: its entries are loaded and every new one is appended; when
    the file is new or empty, this session's entries so far are copied into it first.
    The log is an attribute of the engine object, so `reconfigure` (which rebuilds the cache and scheduler) keeps it.
    """
    log = getattr(engine, "runs", None)
    if not isinstance(log, RunLog) or (path is not None and log.path != os.fspath(path)):
        base = log.base if isinstance(log, RunLog) and log.base is not None else (
            getattr(engine, "user_config", None) or getattr(engine, "config", None))
        new = RunLog(base=base, path=path)
        if isinstance(log, RunLog) and len(log) and not len(new):
            for r in log:  # keep this session's history in the new file
                new.add(r.kind, engine=r.engine, config=r.config, workload=r.workload, metrics=r.metrics,
                        records=r.records, label=r.label, sweep=r.sweep, point=r.point, repeat=r.repeat,
                        time=r.time, note=r.note)
        log = new
        engine.runs = log
    return log
