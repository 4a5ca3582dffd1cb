"""Class mode for the example notebooks: measure the machine once, say before a long cell how long it takes here,
and pick the notebook's size.

Each notebook is sized so that Run All takes at most 5 minutes (aimed at 2-3) on the slow machine of a workshop: a
quiet 2-core laptop whose fp32 GEMM runs at `REFERENCE_FLOPS` (65 GFLOP/s; the slow kind of this project's machine).
`measure()` times a square fp32 GEMM for about a second (the fastest pass counts: other jobs only slow a pass down);
a cell that takes R seconds on the reference machine is estimated to take ``R * REFERENCE_FLOPS / gemm_flops`` here
(the notebooks' long cells are dominated by the model's GEMMs). Each notebook states its long cells' R, measured at
class size (`python -m cbnb.lab.classroom` re-measures every notebook's Run All).

The size is one variable: ``CBNB_SIZE=full`` (or ``SIZE = "full"`` in a notebook's first cell) runs the whole
workloads of the README; "class" (the default) runs the smaller ones, which CI runs too (tests/test_notebooks.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["REFERENCE_FLOPS", "SIZES", "Machine", "measure", "size"]

#: fp32 GEMM FLOP/s of the reference class machine (a quiet 2-core laptop).
REFERENCE_FLOPS = 65e9

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
    """

    gemm_flops: float
    threads: int
    n: int = 1024

    @property
    def speed(self) -> float:
        """How many times faster than the reference class machine (GEMM rate / `REFERENCE_FLOPS`)."""
        return self.gemm_flops / REFERENCE_FLOPS

    def seconds(self, reference_s: float) -> float:
        """Estimated seconds here for what takes `reference_s` on the reference machine."""
        return reference_s / max(self.speed, 1e-6)

    def estimate(self, what: str, reference_s: float) -> str:
        """One line for a notebook, e.g. "The sweep below: about 40 s here (90 s on the 65 GFLOP/s class
        laptop)."."""
        return (f"{what}: about {_dur(self.seconds(reference_s))} here ({_dur(reference_s)} on the "
                f"{REFERENCE_FLOPS / 1e9:.0f} GFLOP/s class laptop).")

    def __str__(self) -> str:
        return (f"this machine: {self.gemm_flops / 1e9:.0f} GFLOP/s fp32 GEMM ({self.threads} torch thread"
                f"{'s' if self.threads != 1 else ''}), {self.speed:.1f}x the {REFERENCE_FLOPS / 1e9:.0f} GFLOP/s "
                "2-core class laptop")


def _dur(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s / 5) * 5 if s >= 20 else round(s)):.0f} s"
    return f"{s / 60:.1f} min"


def measure(seconds: float = 1.0, n: int = 1024) -> Machine:
    """Time an ``n x n`` fp32 matmul for about `seconds` (at least 3 passes after a warm-up) and keep the fastest.

    Returns:
        `Machine` with the rate in FLOP/s (``2 n^3`` per pass).
    """
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # warm-up: allocator, threads
    best, passes, start = float("inf"), 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        passes += 1
    return Machine(2.0 * n ** 3 / best, torch.get_num_threads(), n)


def main(argv: list[str] | None = None) -> int:
    """Run All of each example notebook at its class size (or ``--size full``), headless, and print its time next to
    this machine's GEMM rate and the time that rate predicts on the reference machine."""
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
        m = Machine(max(before.gemm_flops, measure().gemm_flops), before.threads)
        print(f"{path.name}: Run All {took:.0f} s at size {args.size} on {m} -> about {took * m.speed:.0f} s on the "
              "class laptop", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
