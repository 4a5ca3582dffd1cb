"""Trace files: one request per JSONL line or CSV row, what each request shares, and workloads built from them
(torch-free).

`read_trace` reads (and `write_trace` writes) the fields

=================  ========  =================================================================================
field              required  meaning
=================  ========  =================================================================================
``arrival_s``      yes       seconds from the start (a number >= 0; rows need not be sorted)
``prompt_tokens``  one of    prompt length in tokens (an integer >= 1): the prompt is random token ids
``prompt``         these     the prompt text (tokenised by the engine, or by `workloads.from_trace`'s tokenizer)
``output_tokens``  yes       tokens to generate (an integer >= 1; EOS is ignored)
``prefix``         no        a shared-prefix group id (text): rows with the same id start with the same tokens
``prefix_tokens``  with it   how many of this row's ``prompt_tokens`` are the group's (1 .. prompt_tokens)
``hash_ids``       no        Mooncake-style sharing: one id per block of ``block_size`` prompt tokens (a JSON list,
                             or space-separated in CSV); rows with the same id at a position have the same block
``block_size``     no        tokens per hash id (default: `read_trace`'s ``block_size``, 512 as Mooncake's)
=================  ========  =================================================================================

Sharing (``prefix``/``prefix_tokens`` or ``hash_ids``) needs ``prompt_tokens`` (the total prompt length, shared part
included); `cbnb.lab.workloads.from_trace` turns it into equal token ids, so the engine's prefix cache sees what the
traffic shared. `cbnb.lab.mooncake` reads Mooncake's own JSONL into these rows.

CSV files have a header row naming the columns (any order; extra columns are ignored). JSONL lines are objects;
blank lines and lines starting with ``#`` are skipped. A bad row raises `TraceError` naming the file, the line
(1-based, the CSV header is line 1) and the column.

`cbnb.lab.workloads.from_trace` builds a `Workload` from a trace (shared prefixes become equal token ids) and
`cbnb.lab.workloads.trace_rows` writes any workload as rows that keep its sharing.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

__all__ = ["TraceRow", "TraceError", "read_trace", "write_trace"]


class TraceError(ValueError):
    """A bad row in a trace file; `path`, `line` (1-based) and `column` say where."""

    def __init__(self, path: str, line: int, column: str | None, message: str) -> None:
        self.path, self.line, self.column = path, line, column
        where = f"{path}, line {line}" + (f", column {column!r}" if column else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: arrival time (s), prompt length or text, output tokens, and what it shares
    (`prefix` group and `prefix_tokens`, or `hash_ids` of `block_size`-token blocks; see the module doc)."""

    arrival_s: float
    output_tokens: int
    prompt_tokens: int | None = None
    prompt: str | None = None
    prefix: str | None = None
    prefix_tokens: int | None = None
    hash_ids: tuple[int, ...] | None = None
    block_size: int | None = None


_FIELDS = ("arrival_s", "prompt_tokens", "prompt", "output_tokens", "prefix", "prefix_tokens", "hash_ids",
           "block_size")


def _sharing(rec: dict[str, Any], path: str, line: int, prompt_tokens: int | None,
             block_size: int) -> dict[str, Any]:
    """The sharing columns of a row, checked (an empty dict when it shares nothing)."""
    has_prefix = rec.get("prefix") not in (None, "")
    has_hash = rec.get("hash_ids") not in (None, "", [])
    if not (has_prefix or has_hash or rec.get("prefix_tokens") not in (None, "")):
        return {}
    if prompt_tokens is None:
        raise TraceError(path, line, "prefix" if has_prefix else "hash_ids",
                         "sharing needs prompt_tokens (a length), not prompt text")
    if has_prefix and has_hash:
        raise TraceError(path, line, "hash_ids", "give prefix/prefix_tokens or hash_ids, not both")
    if has_hash:
        raw = rec["hash_ids"]
        items = raw.split() if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)):
            raise TraceError(path, line, "hash_ids", f"must be a list of integers; got {raw!r}")
        ids = []
        for h in items:
            try:
                v = int(h) if not isinstance(h, bool) and float(h).is_integer() else None
            except (TypeError, ValueError):
                v = None
            if v is None:
                raise TraceError(path, line, "hash_ids", f"must be integers; got {h!r}")
            ids.append(v)
        bs = block_size
        if rec.get("block_size") not in (None, ""):
            bs = int(_number(rec["block_size"], path, line, "block_size", integer=True))
        return {"hash_ids": tuple(ids), "block_size": bs}
    if not has_prefix:
        raise TraceError(path, line, "prefix", "prefix_tokens needs a prefix group id")
    if rec.get("prefix_tokens") in (None, ""):
        raise TraceError(path, line, "prefix_tokens", "is missing: how many prompt tokens the group shares")
    n = int(_number(rec["prefix_tokens"], path, line, "prefix_tokens", integer=True))
    if n > prompt_tokens:
        raise TraceError(path, line, "prefix_tokens", f"must be <= prompt_tokens ({prompt_tokens}); got {n}")
    return {"prefix": str(rec["prefix"]), "prefix_tokens": n}


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


def _row(rec: dict[str, Any], path: str, line: int, block_size: int = 512) -> TraceRow:
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
        _sharing(rec, path, line, None, block_size)
        return TraceRow(float(arrival), int(out), prompt=rec["prompt"])
    n = _number(rec["prompt_tokens"], path, line, "prompt_tokens", integer=True)
    return TraceRow(float(arrival), int(out), prompt_tokens=int(n), **_sharing(rec, path, line, int(n), block_size))


def jsonl_records(lines: Iterable[str], path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each JSON line; blank lines and ``#`` comments skipped.

    Raises:
        TraceError: a line that is not JSON, or not a JSON object (naming the file and line).
    """
    for i, text in enumerate(lines, start=1):
        s = text.strip()
        if not s or s.startswith("#"):
            continue
        try:
            rec = json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(path, i, None, f"not valid JSON ({e.msg} at character {e.colno})") from None
        if not isinstance(rec, dict):
            raise TraceError(path, i, None, f"must be a JSON object; got {type(rec).__name__}")
        yield i, rec


def read_trace(path: str | os.PathLike, fmt: str | None = None, *, block_size: int = 512) -> list[TraceRow]:
    """Read a JSONL or CSV trace (format from the extension, or `fmt` = "jsonl" / "csv"), in file order.

    `block_size`: tokens per ``hash_ids`` entry for rows without their own ``block_size`` (512, Mooncake's).

    Raises:
        TraceError: a bad row (file, 1-based line, column and what is wrong) or an empty trace.
        ValueError: an unknown format.
    """
    p = os.fspath(path)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (tokens per hash id); got {block_size!r}")
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
                rows.append(_row(rec, p, reader.line_num, block_size))
        else:
            for i, rec in jsonl_records(f, p):
                rows.append(_row(rec, p, i, block_size))
    if not rows:
        raise TraceError(p, 1, None, "the trace has no requests")
    return rows


def write_trace(path: str | os.PathLike, rows: Sequence[TraceRow]) -> None:
    """Write rows as JSONL (``.jsonl``) or CSV (``.csv``) in the format `read_trace` reads."""
    p = os.fspath(path)
    recs = [{k: (list(getattr(r, k)) if k == "hash_ids" else getattr(r, k)) for k in _FIELDS
             if getattr(r, k) is not None} for r in rows]
    with open(p, "w", newline="", encoding="utf-8") as f:
        if p.lower().endswith(".csv"):
            w = csv.DictWriter(f, fieldnames=list(_FIELDS))
            w.writeheader()
            for r in recs:
                if "hash_ids" in r:
                    r["hash_ids"] = " ".join(str(h) for h in r["hash_ids"])
                w.writerow(r)
        else:
            for r in recs:
                f.write(json.dumps(r) + "\n")
