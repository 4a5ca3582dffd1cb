"""The field checks of a `cbnb.sim.profiles.HardwareProfile` (run by its ``__post_init__``): ranges, curve shapes and
dtype names, each error naming the field and what it allows; the curves and cost factors are normalised in place."""

from __future__ import annotations

import math
from typing import Any

from .shapes import normalize_dtype

__all__ = ["check_profile", "COST_FACTORS"]

#: The cost model's groups a profile's `cost_factors` may scale (see `HardwareProfile.cost_factors`).
COST_FACTORS = ("compute", "attention", "decode_attention", "fixed")
_KINDS = ("gpu", "cpu")
_RUNNERS = ("cuda", "cpu")


def _positive(name: str, v: Any, *, zero_ok: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v >= 0 if zero_ok else v > 0)
    if not ok:
        raise ValueError(f"HardwareProfile.{name} must be a {'non-negative' if zero_ok else 'positive'} number; "
                         f"got {v!r}")


def check_profile(prof: Any) -> None:
    """Validate and normalise `prof` (a `HardwareProfile` being built) in place.

    Raises:
        ValueError: a field out of its range, naming the field and the range.
    """
    if not isinstance(prof.name, str) or not prof.name:
        raise ValueError(f"HardwareProfile.name must be a non-empty string; got {prof.name!r}")
    if prof.kind not in _KINDS:
        raise ValueError(f"HardwareProfile.kind must be one of {', '.join(_KINDS)}; got {prof.kind!r}")
    if prof.runner not in _RUNNERS:
        raise ValueError(f"HardwareProfile.runner must be one of {', '.join(_RUNNERS)}; got {prof.runner!r}")
    for f in ("memory_bytes", "memory_bandwidth", "host_device_bandwidth"):
        _positive(f, getattr(prof, f))
    for f in ("step_overhead_s", "step_overhead_graph_s", "kernel_launch_s", "request_overhead_s",
              "reserved_bytes"):
        _positive(f, getattr(prof, f), zero_ok=True)
    for f in ("layer_overhead_s", "attention_call_s", "elementwise_bandwidth", "gather_bandwidth",
              "decode_kernel_bandwidth", "decode_kernel_shared_bandwidth", "host_memory_bytes",
              "interconnect_bandwidth", "interconnect_latency_s"):
        if getattr(prof, f) is not None:
            _positive(f, getattr(prof, f), zero_ok=f not in ("elementwise_bandwidth", "gather_bandwidth",
                                                            "decode_kernel_bandwidth",
                                                            "decode_kernel_shared_bandwidth",
                                                            "interconnect_bandwidth"))
    _positive("decode_kernel_call_s", prof.decode_kernel_call_s, zero_ok=True)
    if prof.past_attention_flops is not None:
        _positive("past_attention_flops", prof.past_attention_flops)
    for f in ("past_attention_key_s", "past_attention_call_s"):
        _positive(f, getattr(prof, f), zero_ok=True)
    if prof.threads is not None and not (isinstance(prof.threads, int) and prof.threads >= 1):
        raise ValueError(f"HardwareProfile.threads must be an integer >= 1 or None; got {prof.threads!r}")
    if prof.cost_factors is not None:
        bad = sorted(set(prof.cost_factors) - set(COST_FACTORS))
        if bad:
            raise ValueError(f"HardwareProfile.cost_factors: unknown group(s) {', '.join(bad)}; allowed: "
                             f"{', '.join(COST_FACTORS)}")
        clean_f: dict[str, Any] = {}
        for k, v in prof.cost_factors.items():
            if k == "compute" and isinstance(v, (list, tuple)):  # a curve: [[rows, factor], ...]
                try:
                    pts = sorted((float(r), float(f)) for r, f in v)
                except (TypeError, ValueError):
                    pts = []
                if not pts or any(r < 1 or not 0 < f < 100 for r, f in pts):
                    raise ValueError("HardwareProfile.cost_factors['compute'] as a curve must be [rows, factor] "
                                     f"pairs with rows >= 1 and factors in (0, 100); got {v!r}")
                clean_f[k] = [list(p) for p in pts]
                continue
            if not (isinstance(v, (int, float)) and 0 < v < 100):
                raise ValueError(f"HardwareProfile.cost_factors[{k!r}] must be in (0, 100); got {v!r}")
            clean_f[k] = float(v)
        object.__setattr__(prof, "cost_factors", clean_f)
    for f in ("flops_efficiency", "bandwidth_efficiency"):
        v = getattr(prof, f)
        if not (isinstance(v, (int, float)) and 0 < v <= 1):
            raise ValueError(f"HardwareProfile.{f} must be in (0, 1]; got {v!r}")
    if not prof.peak_flops:
        raise ValueError("HardwareProfile.peak_flops must name at least one dtype")
    peaks = {}
    for k, v in dict(prof.peak_flops).items():
        key = "tf32" if k == "tf32" else normalize_dtype(k)
        _positive(f"peak_flops[{k!r}]", v)
        peaks[key] = float(v)
    object.__setattr__(prof, "peak_flops", peaks)
    for f in ("gemm_flops", "attention_flops", "elementwise_curve"):
        curves = getattr(prof, f)
        if curves is None:
            continue
        clean = {}
        for k, pts in dict(curves).items():
            rows = sorted((float(m), float(r)) for m, r in pts)
            if not rows or any(m <= 0 or r <= 0 for m, r in rows):
                raise ValueError(f"HardwareProfile.{f}[{k!r}] must be non-empty [rows, rate] pairs, all > 0")
            clean[normalize_dtype(k)] = [list(p) for p in rows]
        object.__setattr__(prof, f, clean)
    if prof.memory_bytes <= prof.reserved_bytes:
        raise ValueError(f"HardwareProfile.reserved_bytes ({prof.reserved_bytes}) must be below memory_bytes "
                         f"({prof.memory_bytes})")
