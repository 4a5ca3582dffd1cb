"""`calibrate()`: measure this machine's ``cpu`` profile with microbenchmarks at a model's shapes (about a minute).

What is measured (medians of repeated timings; nothing here looks at the validation workloads):

1. **memory bandwidth**: a 256 MiB copy, bytes read + written per second; the swap path's rate (``index_select`` +
   ``index_copy_`` of whole blocks, as `cbnb.runner.kv.KVStore` copies them) as the host<->device bandwidth;
2. **GEMM FLOP/s by rows**: the shape's seven decoder projections at 1 .. 512 rows, cycling through as many distinct
   layers' weights as fit in 512 MiB so that weights stream from memory as in a forward, minus one dispatch per call;
3. **attention FLOP/s by query rows**: `scaled_dot_product_attention` at the shape's heads, causal chunks of 16 .. 512
   rows and single decode rows over 512 keys, minus one call's dispatch; and the CPU runner's batched decode path
   (its page gather and masked attention) as a bandwidth over the bytes the cost model counts for it; and its
   prefill path over a past (page gather + masked attention) at 16 and 64 query rows over 128 and 512 past keys:
   per call, per key and a FLOP rate, by least squares;
4. **elementwise rate by rows**: one decoder layer's RMSNorms, RoPE, SiLU * up and residual adds at 1 .. 512 rows,
   the L2 cache flushed before each run as a layer's weights flush it in a forward;
5. **fixed costs**: `cbnb.Engine` (its runner, paged attention, sampler, core and telemetry) serving two tiny random
   models of the shape's architecture (width 64, so that compute is negligible) with 2 and 8 layers, at 1, 8 and 16
   decode rows: the per-step overhead, per decoder layer, per attention call and per request, by least squares;
6. **per-kernel dispatch**: one small tensor op;
7. **end-to-end factors** (`HardwareProfile.cost_factors`): `cbnb.Engine` serving a random-weight model of the shape
   (four short runs, each twice with a step's fastest time kept: a lone 480-token prompt, 4 short prompts, 12
   mid-sized ones in chunks with a past, 32 short ones; none is a validation workload), and the cost model's groups (compute, prefill attention, decode attention, fixed costs)
   scaled to its measured step times by least squares on relative error. The microbenchmarks time each operator
   alone; in a forward, operators share the caches and the cores with their neighbours, which they do not see
   (measured 2026-12-03: steps ~1.3-1.5x the microbenchmarks' sum on this 2-core machine).

With torch absent, a rough profile comes from NumPy (bandwidth, GEMMs, one op's cost); the fixed costs are then
estimated from the op cost and kernel counts, and the profile's notes say so.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from ..sim.profiles import HardwareProfile
from ..sim.shapes import load_shape

__all__ = ["calibrate"]



def _available_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a cbnb dependency
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def calibrate(shape: Any = "smollm2-135m", *, dtype: str = "float32", name: str = "cpu", threads: int | None = None,
              save: bool | str = True, quick: bool = False, budget_s: float = 60.0,
              verbose: bool = False, busy: str = "warn", fit: bool | None = None, model: Any = None) -> HardwareProfile:
    """Measure this CPU as a `HardwareProfile` (see the module docstring for what and how).

    Args:
        shape: the model shape whose GEMM and attention sizes are measured (a name or anything `load_shape` takes).
        dtype: "float32" (cbnb's CPU dtype) or "bfloat16".
        name: the profile's name ("cpu" is what `load_profile("cpu")` reads).
        threads: torch intra-op threads while measuring (default: torch's current setting, as the engine runs).
        save: True: save to `profile_cache_dir()/<name>.json`; a path: save there; False: do not save.
        quick: fewer repetitions and rows (for tests; a few seconds, less precise).
        budget_s: time budget (seconds); the GEMM rounds stop early past half of it. For smollm2-135m it took 27 s
            on the 2-core development machine (1 thread, while other jobs loaded it).
        verbose: print each measurement.
        busy: what to do when the machine is busy (`machine_busy`: the 1-minute load average is at least the
            number of cores before measuring, or after it above the cores plus our own threads): "warn" (default: a
            RuntimeWarning, and the profile is marked: ``provenance["details"]["busy"]`` and its notes),
            "refuse" (RuntimeError before measuring anything), "ignore".
        fit: also measure `HardwareProfile.cost_factors` end to end (step 7 of the module docstring; about 25-40 s
            for smollm2-135m on a 2-core machine); default: unless `quick`. Needs torch and transformers.
        model: a loaded model of the shape to run the end-to-end runs on (its weights do not matter); default: a
            random-weight one built from the shape (at most 1 GiB of weights: fewer layers for a larger shape).

    Returns:
        The profile (saved unless `save` is False); ``provenance`` is {"kind": "calibrated", "details": {load
        averages before and after, busy, threads}}.

    Raises:
        RuntimeError: `busy` is "refuse" and the machine is busy.
        ValueError: `busy` is not one of "warn", "refuse", "ignore".
    """
    if busy not in ("warn", "refuse", "ignore"):
        raise ValueError(f"busy must be 'warn', 'refuse' or 'ignore'; got {busy!r}")
    load0 = _loadavg()
    cores = os.cpu_count() or 1
    if busy != "ignore" and load0 is not None and load0 >= cores:
        msg = (f"calibrate(): the machine is busy (load average {load0:.1f} on {cores} cores): every figure would "
               "measure the other jobs too (a loaded 2-core machine measures ~10 GFLOP/s GEMMs where a quiet one "
               "does ~68); measure when it is idle")
        if busy == "refuse":
            raise RuntimeError(msg)
        warnings.warn(msg + "; the profile is marked busy", RuntimeWarning, stacklevel=2)
    t_start = time.perf_counter()
    s = load_shape(shape, dtype=dtype)
    log = print if verbose else (lambda *a, **k: None)
    try:
        from . import _torch as impl
    except ImportError:  # no torch (or no transformers): NumPy microbenchmarks only
        from . import _numpy as impl  # type: ignore[no-redef]
    figures = impl.measure(s, threads=threads, quick=quick, log=log, budget_s=budget_s)
    load1 = _loadavg()
    is_busy = machine_busy(load0, load1, cores, int(figures.get("threads") or 1)) or bool(figures.get("noisy"))
    if figures.get("noisy"):
        warnings.warn("calibrate(): step times fell with more layers or more rows; the machine was too busy for "
                      "reliable figures (retry when it is idle, or with threads=1)", RuntimeWarning, stacklevel=2)
    mem = _available_memory()
    past, kernel = figures.get("past_attention") or {}, figures.get("decode_kernel") or {}
    pre = figures.get("prefill_kernel") or {}
    profile = HardwareProfile(
        name=name, kind="cpu", runner="cpu", memory_bytes=mem, host_memory_bytes=mem,
        peak_flops={s.dtype: max(r for _, r in figures["gemm"])},
        memory_bandwidth=figures["bandwidth"], host_device_bandwidth=figures["swap_bandwidth"],
        step_overhead_s=figures["step_s"], step_overhead_graph_s=figures["step_s"],
        kernel_launch_s=figures["op_s"], layer_overhead_s=figures["layer_s"], attention_call_s=figures["call_s"],
        request_overhead_s=figures["request_s"], gemm_flops={s.dtype: figures["gemm"]},
        attention_flops={s.dtype: figures["attention"]}, elementwise_curve={s.dtype: figures["elementwise"]},
        gather_bandwidth=figures.get("gather"),
        past_attention_flops=past.get("flops"), past_attention_key_s=past.get("key_s", 0.0),
        past_attention_call_s=past.get("call_s", 0.0),
        decode_kernel_bandwidth=kernel.get("bandwidth"), decode_kernel_call_s=kernel.get("call_s", 0.0),
        decode_kernel_shared_bandwidth=kernel.get("shared_bandwidth"),
        prefill_kernel_flops=pre.get("flops"), prefill_kernel_call_s=pre.get("call_s", 0.0),
        threads=int(figures.get("threads") or 1),
        sources={k: f"measured by cbnb.measure.calibrate ({figures['backend']}): {v}" for k, v in impl.METHODS.items()},
        notes=(f"calibrated at shape {s.name} ({s.dtype}) with {figures['threads']} threads, {figures['backend']}, "
               f"on {time.strftime('%Y-%m-%d %H:%M')}, in {time.perf_counter() - t_start:.0f} s"
               + ("" if figures["backend"].startswith("torch") else "; fixed costs estimated, not measured")
               + ("; NOISY: step times fell with more layers or rows (machine busy)" if figures.get("noisy") else "")
               + (f"; BUSY: load average {load0} before, {load1} after" if is_busy else "")),
        provenance={"kind": "calibrated", "details": {"shape": s.name, "dtype": s.dtype,
                                                      "load_average_before": load0, "load_average_after": load1,
                                                      "cores": cores, "threads": figures.get("threads"),
                                                      "busy": is_busy}},
    )
    if (not quick if fit is None else fit) and figures["backend"].startswith("torch"):
        import torch

        threads_before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            from ._torch_fit import fit_factors  # the torch back-end's engine runs (not in _torch since the split)

            res = fit_factors(s, profile, log, model=model)
        finally:
            torch.set_num_threads(threads_before)
        details = dict(profile.provenance["details"], cost_factor_fit=res)
        profile = profile.replace(cost_factors=res["factors"],
                                  provenance=dict(profile.provenance, details=details),
                                  notes=profile.notes + f"; cost factors {res['factors']} fitted on {res['steps']} "
                                  f"engine steps (their median error {res['error_pct_before']} % -> "
                                  f"{res['error_pct_after']} %)")
    if save:
        path = profile.save(None if save is True else save)
        log(f"saved {path}")
    return profile


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on this platform
        return None


def machine_busy(before: float | None, after: float | None, cores: int, threads: int) -> bool:
    """Whether a calibration was measured on a busy machine: the 1-minute load average was at least `cores` before
    it started (every core already had a runnable process), or above ``cores + threads`` after it (others ran
    alongside our own `threads`). Unknown load averages count as not busy."""
    return (before is not None and before >= cores) or (after is not None and after > cores + threads)
