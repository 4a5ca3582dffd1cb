"""Interleaved rounds and their statistics (pure Python: no torch, no model).

A noisy machine (shared cores, one run swinging 3x) makes a single timing meaningless. The bench therefore runs
every peer once per round, rotating the order each round (round r starts with peer ``r mod n``) so that no peer
always runs first (cold) or last (after the others warmed or heated the machine), and reports:

- per peer, the median and min-max of its output tokens/s over the rounds;
- the median (and min-max) of the *per-round* ratios ``tok/s of the first peer / tok/s of this peer``: both sides of
  a ratio ran minutes apart at most, so a machine-wide slowdown cancels out;
- per peer, the median share of the roofline floor, when a floor is known per round
  (``floor seconds / peer seconds``, the floor computed from that round's own GEMM and bandwidth probe).

A round in which a peer failed leaves that peer's figures (and ratios) out of the medians; the count of rounds each
figure rests on is reported beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["Entry", "Round", "rotation", "run_rounds", "spread", "summarize"]


@dataclass
class Entry:
    """One competitor in the rounds: a name and a callable that runs it once and returns a `PeerResult`-like
    object (attributes ``seconds``, ``output_tokens``, ``tok_per_s``, ``tokens``, ``error``, ``extra``)."""

    name: str
    run: Callable[[], Any]


@dataclass
class Round:
    """One round: the order the entries ran in, their results by name, and the machine probe taken first."""

    index: int
    order: list[str]
    results: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=dict)


def rotation(n: int, round_index: int) -> list[int]:
    """Entry indices in the order round `round_index` runs them: ``[k, k+1, ..., n-1, 0, ..., k-1]``, k = r mod n.

    Over n consecutive rounds every entry runs once in every position.
    """
    if n <= 0:
        return []
    k = round_index % n
    return list(range(k, n)) + list(range(k))


def run_rounds(entries: Sequence[Entry], repeat: int, probe: Callable[[], dict[str, Any]] | None = None,
               between: Callable[[], None] | None = None,
               on_round: Callable[[Round], None] | None = None) -> list[Round]:
    """Run `repeat` rounds of all `entries` in rotated order.

    Args:
        entries: the competitors (names must be unique).
        repeat: rounds (>= 1).
        probe: called at the start of each round; its dict is kept as the round's machine state (GEMM rate,
            bandwidth).
        between: called before each entry's run (e.g. to release the previous engine's memory).
        on_round: called after each round (progress output, partial JSON).

    Raises:
        ValueError: repeat < 1, no entries, or duplicate names.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1; got {repeat}")
    names = [e.name for e in entries]
    if not names:
        raise ValueError("no entries to run")
    if len(set(names)) != len(names):
        raise ValueError(f"entry names must be unique; got {names}")
    rounds: list[Round] = []
    for r in range(repeat):
        machine = probe() if probe is not None else {}
        order = [entries[i] for i in rotation(len(entries), r)]
        results: dict[str, Any] = {}
        for e in order:
            if between is not None:
                between()
            results[e.name] = e.run()
        rnd = Round(r, [e.name for e in order], results, machine)
        rounds.append(rnd)
        if on_round is not None:
            on_round(rnd)
    return rounds


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of `xs` (None values for an empty sequence)."""
    xs = [float(x) for x in xs]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _ok(result: Any) -> bool:
    return result is not None and not result.error and result.seconds > 0 and result.output_tokens > 0


def _agree(a: Any, b: Any) -> float:
    if not a.tokens or len(a.tokens) != len(b.tokens):
        return 0.0
    return sum(x == y for x, y in zip(a.tokens, b.tokens)) / len(a.tokens)


def summarize(rounds: Sequence[Round], names: Sequence[str],
              floor_s: Sequence[float | None] | None = None) -> dict[str, dict[str, Any]]:
    """Per entry: tok/s and seconds spreads, the per-round ratio ``first / this`` (tok/s), greedy agreement with the
    first entry (worst round), the roofline share, and the errors seen.

    Args:
        rounds: from `run_rounds`.
        names: entry names; the first is the reference of the ratios and the token agreement.
        floor_s: per round, the roofline floor of the workload in seconds (None: unknown for that round).
    """
    base = names[0]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        tps, secs, ratios, shares, agree, errors = [], [], [], [], [], []
        for i, rnd in enumerate(rounds):
            r = rnd.results.get(name)
            if r is None:
                continue
            if not _ok(r):
                errors.append(r.error or "no output")
                continue
            tps.append(r.tok_per_s)
            secs.append(r.seconds)
            b = rnd.results.get(base)
            if b is not None and _ok(b):
                ratios.append(b.tok_per_s / r.tok_per_s)
                agree.append(_agree(b, r))
            f = floor_s[i] if floor_s is not None and i < len(floor_s) else None
            if f:
                shares.append(f / r.seconds)
        out[name] = {
            "tok_per_s": spread(tps),
            "seconds": spread(secs),
            "first_over_this": spread(ratios),
            "roofline_share": spread(shares),
            "greedy_agreement_min": min(agree) if agree else None,
            "errors": errors,
        }
    return out
