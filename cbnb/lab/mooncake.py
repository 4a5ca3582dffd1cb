"""Mooncake-style traces: JSONL with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``
(torch-free).

The format is the one of the traces published with Mooncake (Qin et al., "Mooncake: A KVCache-centric
Disaggregated Architecture for LLM Serving", FAST 2025; ``mooncake_trace.jsonl``): one JSON object per line,

================  ========================================================================================
``timestamp``     arrival time in milliseconds (any origin; the first request's time becomes 0)
``input_length``  prompt tokens (an integer >= 1)
``output_length`` tokens to generate (an integer >= 1; 0 is raised to 1, as a request makes at least one)
``hash_ids``      one id per block of `block_size` prompt tokens (512 in the published traces): requests that
                  carry the same id at the same position share that block, and every block before it
================  ========================================================================================

`read_mooncake` turns the lines into `cbnb.lab.traffic.TraceRow`s (``arrival_s`` in seconds from the first request,
``prompt_tokens``, ``output_tokens``, ``hash_ids``, ``block_size``); `from_mooncake` builds the `Workload`, where
equal hash ids become equal blocks of token ids, so the engine's prefix cache hits what the trace shares
(`cbnb.lab.workloads.from_trace`). Other keys on a line are ignored.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .traces import jsonl_records
from .traffic import TraceError, TraceRow

__all__ = ["read_mooncake", "from_mooncake"]


def _int(rec: dict[str, Any], key: str, path: str, line: int, lo: int) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not float(v).is_integer() \
            or v < lo:
        raise TraceError(path, line, key, f"must be an integer >= {lo}; got {v!r}")
    return int(v)


def read_mooncake(path: str | os.PathLike, *, block_size: int = 512) -> list[TraceRow]:
    """The requests of a Mooncake JSONL trace, in file order (see the module doc).

    Args:
        block_size: prompt tokens per hash id (512 in Mooncake's traces).

    Raises:
        TraceError: a bad line (file, 1-based line, key), an empty trace, or hash ids that cover fewer than
            ``input_length - block_size + 1`` tokens (the trace does not describe the whole prompt).
        ValueError: block_size < 1.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (tokens per hash id); got {block_size!r}")
    p = os.fspath(path)
    raw: list[tuple[int, float, int, int, tuple[int, ...]]] = []
    with open(p, encoding="utf-8") as f:
        for i, rec in jsonl_records(f, p):
            ts = rec.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise TraceError(p, i, "timestamp", f"must be a number of milliseconds; got {ts!r}")
            n_in = _int(rec, "input_length", p, i, 1)
            n_out = max(1, _int(rec, "output_length", p, i, 0))
            hs = rec.get("hash_ids", [])
            if not isinstance(hs, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hs):
                raise TraceError(p, i, "hash_ids", f"must be a list of integers; got {hs!r}")
            if len(hs) * block_size < n_in - block_size + 1:
                raise TraceError(p, i, "hash_ids", f"{len(hs)} ids of {block_size} tokens cover less than "
                                                   f"input_length {n_in}: is block_size right?")
            raw.append((i, float(ts), n_in, n_out, tuple(hs)))
    if not raw:
        raise TraceError(p, 1, None, "the trace has no requests")
    t0 = min(r[1] for r in raw)
    return [TraceRow((ts - t0) / 1000.0, n_out, prompt_tokens=n_in, hash_ids=hs or None,
                     block_size=block_size if hs else None) for _, ts, n_in, n_out, hs in raw]


def from_mooncake(path: str | os.PathLike, *, block_size: int = 512, name: str | None = None,
                  model: str = "smollm2-135m", vocab_size: int = 49152, seed: int = 0,
                  config_hints: dict[str, Any] | None = None) -> Any:
    """A `cbnb.lab.workloads.Workload` from a Mooncake trace: equal hash ids are equal token blocks.

    Raises:
        TraceError / ValueError: as `read_mooncake`.
    """
    from .workloads import from_trace

    rows = read_mooncake(path, block_size=block_size)
    nm = name or os.path.splitext(os.path.basename(os.fspath(path)))[0]
    wl = from_trace(rows, name=nm, model=model, vocab_size=vocab_size, seed=seed, config_hints=config_hints,
                    block_size=block_size)
    traffic = dict(wl.traffic, arrivals={"kind": "trace", "path": os.fspath(path), "format": "mooncake"},
                   block_size=block_size)
    from dataclasses import replace

    return replace(wl, traffic=traffic, description=f"Mooncake trace {os.fspath(path)} ({len(rows)} requests)")
