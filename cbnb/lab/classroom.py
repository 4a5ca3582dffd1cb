"""Class mode for the example notebooks: measure the machine once, say before a long cell how long it takes here,
and pick the notebook's size.

Each notebook is sized so that Run All takes at most 5 minutes (aimed at 2-3) on the slow machine of a workshop: a
quiet 2-core laptop whose fp32 GEMM runs at `REFERENCE_FLOPS` (65 GFLOP/s; the slow kind of this project's machine).
`measure()` times a square fp32 GEMM for about a second (the fastest pass counts: other jobs only slow a pass down);
a cell that takes R seconds on the reference machine is estimated to take ``R * REFERENCE_FLOPS / gemm_flops`` here
(the notebooks' long cells are dominated by the model's GEMMs). Each notebook states its long cells' R, measured at
class size (`python -m cbnb.lab.classroom` re-measures every notebook's Run All).

A simulation (notebook 05) runs no GEMM: its time is the scheduler's and the cost model's Python, so its cells are
scaled by a pure-Python probe instead (`python_probe_seconds`, about 0.1 s): ``R * python_s / REFERENCE_PYTHON_S``.
The class laptop's Python speed was not measured: `REFERENCE_PYTHON_S` assumes it runs Python at half the speed of
the Xeon the probe was calibrated on (2026-12-07, where notebook 05's sweep took 56 s against the 31 s its GEMM
rate predicted), a conservative guess (single-thread Python differs far less between CPUs than GEMM rates do).

A machine whose cores other jobs hold (a shared server; a laptop running a video call) slows a decode step far more
than its GEMM rate says: each of the model's small ops waits until every torch thread got a core, and with 2
threads on 2 busy cores a 1 x 576 x 576 matmul took ~0.8 ms instead of ~0.06 ms on 1 thread (this project's shared
machine at load 8, 2026-12-07), a 10x slower engine. The waits come in bursts, so one short timing can miss them:
`measure()` keeps torch at 1 thread, and says so, where the 1-minute load average is at least the number of cores
(more runnable jobs than cores) or a chain of small ops ran more than twice as fast at 1 thread as at the current
count.

The size is one variable: ``CBNB_SIZE=full`` (or ``SIZE = "full"`` in a notebook's first cell) runs the whole
workloads of the README; "class" (the default) runs the smaller ones, which CI runs too (tests/test_notebooks.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["BUSY_RATIO", "REFERENCE_FLOPS", "REFERENCE_PYTHON_S", "SIZES", "Machine", "measure", "python_probe_seconds",
           "size", "small_op_seconds"]

#: fp32 GEMM FLOP/s of the reference class machine (a quiet 2-core laptop).
REFERENCE_FLOPS = 65e9

#: `python_probe_seconds()` on the reference class machine (assumed: twice the 0.022 s measured on a 2-core Xeon,
#: Sapphire Rapids, 2026-12-07; see the module docstring).
REFERENCE_PYTHON_S = 0.044

#: The notebooks' sizes: "class" (Run All within a class slot on the reference machine) and "full".
SIZES = ("class", "full")


def size(default: str = "class") -> str:
    """The notebooks' size: ``$CBNB_SIZE`` when set, else `default`.

    Raises:
        ValueError: a size other than those in `SIZES`.
    """
    s = os.environ.get("CBNB_SIZE", "").strip().lower() or default
    if s not in SIZES:
        raise ValueError(f"CBNB_SIZE must be one of {', '.join(SIZES)}; got {s!r}")
    return s


@dataclass(frozen=True)
class Machine:
    """This machine's measured fp32 GEMM rate.

    Attributes:
        gemm_flops: FLOP/s of the fastest square GEMM pass (fp32, at `threads` torch threads).
        threads: torch threads when measured.
        n: the GEMM's size (n x n by n x n).
        busy_from: the torch threads there were before `measure()` set 1 (their small ops waited on busy cores),
            else None.
        busy_ratio: how many times slower those small ops ran at `busy_from` threads than at 1.
        load: the 1-minute load average when measured (None where the OS has none).
        cores: the machine's logical cores.
        python_s: seconds of the pure-Python probe (`python_probe_seconds`, fastest pass), None where not measured
            (Python-bound estimates then scale by the GEMM rate).
    """

    gemm_flops: float
    threads: int
    n: int = 1024
    busy_from: int | None = None
    busy_ratio: float = 1.0
    load: float | None = None
    cores: int = 0
    python_s: float | None = None

    @property
    def speed(self) -> float:
        """How many times faster than the reference class machine (GEMM rate / `REFERENCE_FLOPS`)."""
        return self.gemm_flops / REFERENCE_FLOPS

    @property
    def python_speed(self) -> float:
        """How many times faster at pure Python than the reference class machine (`REFERENCE_PYTHON_S` /
        `python_s`); `speed` where the probe was not run."""
        return REFERENCE_PYTHON_S / self.python_s if self.python_s else self.speed

    @property
    def shared(self) -> float:
        """How many times longer a long cell takes because other jobs share the cores: the 1-minute load average
        over the core count, at least 1. (`gemm_flops` is the fastest pass, what a core free of other jobs gives; over
        a cell of many seconds a job gets about cores / load of the machine.)"""
        if self.load is None or not self.cores:
            return 1.0
        return max(1.0, self.load / self.cores)

    def seconds(self, reference_s: float, bound: str = "gemm") -> float:
        """Estimated seconds here for what takes `reference_s` on the reference machine (slower by `shared` where
        other jobs hold the cores). `bound`: "gemm" (the model's matmuls: scaled by `speed`) or "python" (a
        simulation: scaled by `python_speed`).

        Raises:
            ValueError: `bound` is neither "gemm" nor "python".
        """
        if bound not in ("gemm", "python"):
            raise ValueError(f"bound must be 'gemm' or 'python'; got {bound!r}")
        speed = self.speed if bound == "gemm" else self.python_speed
        return reference_s / max(speed, 1e-6) * self.shared

    def estimate(self, what: str, reference_s: float, at_least_s: float = 0.0, bound: str = "gemm") -> str:
        """One line for a notebook, e.g. "The sweep below: about 40 s here (90 s on the 65 GFLOP/s class
        laptop).".

        Args:
            at_least_s: seconds the cell takes on any machine (runs that replay arrivals over wall time last at
                least until their last arrival); the estimate is never below it, and says so when it is the bound.
            bound: what the cell's time scales with, as in `seconds`.
        """
        here = self.seconds(reference_s, bound)
        if at_least_s > here:
            return (f"{what}: at least {_dur(at_least_s)} here (its arrivals alone take that long; its compute, "
                    f"{_dur(reference_s)} on the {REFERENCE_FLOPS / 1e9:.0f} GFLOP/s class laptop).")
        return (f"{what}: about {_dur(here)} here ({_dur(reference_s)} on the {REFERENCE_FLOPS / 1e9:.0f} GFLOP/s "
                "class laptop).")

    def __str__(self) -> str:
        line = (f"this machine: {self.gemm_flops / 1e9:.0f} GFLOP/s fp32 GEMM ({self.threads} torch thread"
                f"{'s' if self.threads != 1 else ''}), {self.speed:.1f}x the {REFERENCE_FLOPS / 1e9:.0f} GFLOP/s "
                "2-core class laptop")
        if self.python_s:
            line += f"; Python {self.python_speed:.1f}x its (assumed) speed"
        if self.busy_from is not None:
            load = f" (load average {self.load:.1f} on {self.cores} cores)" if self.load is not None else ""
            seen = f" (here {self.busy_ratio:.0f}x slower than at 1)" if self.busy_ratio >= BUSY_RATIO else ""
            line += (f"\nits cores are busy with other jobs{load}: at {self.busy_from} torch threads each of the "
                     f"model's small ops waits for every thread to get a core{seen}, so torch now runs 1 thread "
                     "(torch.set_num_threads)")
        if self.shared > 1.0:
            line += (f"\nthe estimates below allow for the other jobs: a long cell gets about 1/{self.shared:.1f} of "
                     "the machine")
        return line


def _dur(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s / 5) * 5 if s >= 20 else round(s)):.0f} s"
    return f"{s / 60:.1f} min"


def small_op_seconds(ops: int = 180, width: int = 576) -> float:
    """Mean seconds per op of a chain of `ops` ``1 x width @ width x width`` fp32 matmuls (a decode step's shape;
    576 is SmolLM2-135M's hidden size) at torch's current thread count. The mean, not the fastest: on busy cores the
    waits come in bursts (a fast chain, then one 60x slower), and a decode step meets them all."""
    import torch

    a, w = torch.randn(1, width), torch.randn(width, width) / width ** 0.5
    for _ in range(10):
        a @ w
    t0 = time.perf_counter()
    x = a
    for _ in range(ops):
        x = x @ w
    return (time.perf_counter() - t0) / ops


def python_probe_seconds(passes: int = 5, n: int = 100_000) -> float:
    """Fastest of `passes` runs of a fixed pure-Python loop shaped like a scheduler step (attribute updates, list
    appends, dict stores, a keyed sort over 64 requests; `n` updates in all): the seconds one pass takes, about 0.022 s
    on a Sapphire Rapids Xeon. The fastest pass counts: other jobs only slow a pass down."""

    class _Req:
        __slots__ = ("rid", "blocks", "done")

        def __init__(self, rid: int):
            self.rid, self.blocks, self.done = rid, [], 0

    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        live, table = [_Req(i) for i in range(64)], {}
        for step in range(n // 64):
            for r in live:
                r.blocks.append(step)
                r.done += 1
                table[(r.rid, step & 15)] = len(r.blocks)
            live.sort(key=lambda r: (r.done, -r.rid))
            if len(table) > 4096:
                table.clear()
            for r in live:
                if len(r.blocks) > 32:
                    del r.blocks[:16]
        best = min(best, time.perf_counter() - t0)
    return best


#: 1 thread's small ops this many times faster than the current count's: the cores are busy, keep 1 thread.
BUSY_RATIO = 2.0


def measure(seconds: float = 1.0, n: int = 1024, busy_check: bool = True, python: bool = True) -> Machine:
    """Time an ``n x n`` fp32 matmul for about `seconds` (at least 3 passes after a warm-up) and keep the fastest;
    with `python`, also the pure-Python probe (`python_probe_seconds`, about 0.1 s).

    With `busy_check` and more than one torch thread, first time a chain of a decode step's small matmuls
    (`small_op_seconds`) at the current thread count and at 1 thread; where 1 thread is more than `BUSY_RATIO` times
    faster, or the 1-minute load average is at least the core count (other jobs hold the cores), torch is left at
    1 thread (``torch.set_num_threads(1)``) and the GEMM is timed there.

    Returns:
        `Machine` with the rate in FLOP/s (``2 n^3`` per pass).
    """
    import torch

    busy_from, busy_ratio = None, 1.0
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no load average
        load = None
    if busy_check and threads > 1:
        many = small_op_seconds()
        torch.set_num_threads(1)
        one = small_op_seconds()
        if many > BUSY_RATIO * one or (load is not None and load >= cores):
            busy_from, busy_ratio = threads, many / one
        else:
            torch.set_num_threads(threads)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # warm-up: allocator, threads
    best, passes, start = float("inf"), 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        passes += 1
    python_s = python_probe_seconds() if python else None
    return Machine(2.0 * n ** 3 / best, torch.get_num_threads(), n, busy_from, busy_ratio, load, cores, python_s)


def main(argv: list[str] | None = None) -> int:
    """Run All of each example notebook at its class size (or ``--size full``), headless, and print its time next to
    this machine's GEMM rate and Python speed, and the times they predict on the reference machine."""
    import argparse
    import pathlib

    p = argparse.ArgumentParser(prog="python -m cbnb.lab.classroom", description=main.__doc__)
    p.add_argument("notebooks", nargs="*", help="notebook paths (default: examples/*.ipynb)")
    p.add_argument("--size", choices=SIZES, default="class")
    args = p.parse_args(argv)
    import nbformat
    from nbclient import NotebookClient

    paths = [pathlib.Path(x) for x in args.notebooks] or sorted(pathlib.Path("examples").glob("*.ipynb"))
    os.environ["CBNB_SIZE"] = args.size
    for path in paths:
        before = measure()
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=1800, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        took = time.perf_counter() - t0
        after = measure()
        m = Machine(max(before.gemm_flops, after.gemm_flops), before.threads,
                    python_s=min(before.python_s or 1.0, after.python_s or 1.0))
        print(f"{path.name}: Run All {took:.0f} s at size {args.size} on {m} -> on the class laptop about "
              f"{took * m.speed / m.shared:.0f} s if its time is the model's GEMMs, "
              f"{took * m.python_speed / m.shared:.0f} s if it is Python (a simulation)", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
