"""Hardware profiles: what one device offers the cost model (torch-free).

A `HardwareProfile` gives memory, dense peak FLOP/s per dtype, memory and host<->device bandwidth, and the fixed
costs of a step (host overhead with and without CUDA graphs, per-kernel launch, per decoder layer, per attention
call, per scheduled request). Bundled GPU profiles (``cbnb/sim/data/profiles/*.json``: h100-sxm, h200, a100-80gb,
l4, rtx-4090) copy their memory, FLOP/s and bandwidth figures from the vendors' datasheets, each cited in the file;
the overheads and achievable fractions there are stated assumptions until `cbnb.measure.calibrate()` measures them on the
device. The ``cpu`` profile is measured on this machine by `cbnb.measure.calibrate()` and saved under
``~/.cache/cbnb/sim/cpu.json`` (or ``$CBNB_CACHE_DIR/sim``).

Units: bytes, bytes per second, FLOP per second, seconds. `peak_flops` keys are dtype names ("float32",
"bfloat16", "float16", "float8_e4m3fn"); "tf32" is the TF32 tensor rate, used for float32 GEMMs only when
`allow_tf32` is set.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ._profile_checks import COST_FACTORS, check_profile  # noqa: F401 (COST_FACTORS: re-exported)
from .shapes import normalize_dtype
from .trust import CALIBRATED_PREFIXES, TRUST_TEXT, VALIDATION  # noqa: F401 (TRUST_TEXT, VALIDATION: re-exported)

__all__ = ["HardwareProfile", "load_profile", "PROFILE_NAMES", "profile_cache_dir", "profile_for_device", "TRUST_TEXT",
           "VALIDATION"]

_DATA = pathlib.Path(__file__).resolve().parent / "data" / "profiles"
PROFILE_NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in _DATA.glob("*.json"))) + ("cpu",)


def profile_cache_dir() -> pathlib.Path:
    """Where measured profiles are saved: ``$CBNB_CACHE_DIR/sim`` or ``~/.cache/cbnb/sim``."""
    env = os.environ.get("CBNB_CACHE_DIR")
    root = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "cbnb"
    return root / "sim"


@dataclass(frozen=True)
class HardwareProfile:
    """One device as the cost model sees it.

    Attributes:
        name: profile name ("h100-sxm", "cpu", ...).
        kind: "gpu" or "cpu" (how `ContinuousBatchingConfig.resolve` treats it: CUDA graphs and async batching only
            on "gpu").
        runner: which cbnb runner's attention call structure the cost model follows: "cuda" (one fused attention
            kernel per layer) or "cpu" (one call per prefill chunk and per single-page decode row, per layer).
        memory_bytes: device memory (bytes).
        peak_flops: dense peak FLOP/s per dtype name.
        memory_bandwidth: device memory bandwidth (bytes/s).
        host_device_bandwidth: one direction of the host link (bytes/s); swap copies use it.
        step_overhead_s: host time per step without CUDA graphs (schedule, batch packing, update).
        step_overhead_graph_s: host time per step with a CUDA graph replay.
        kernel_launch_s: host cost of one eagerly launched kernel (CPU: one operator dispatch).
        layer_overhead_s: eager launch cost of one decoder layer outside attention; None: `layer_kernels` *
            `kernel_launch_s`.
        layer_kernels: kernels one decoder layer launches outside attention (eager).
        attention_call_s: cost of one attention call (one layer) beyond its data; None: 2 * `kernel_launch_s`.
        request_overhead_s: host time per scheduled request per step (packing, sampling, token update).
        flops_efficiency: achievable fraction of `peak_flops` in dense GEMMs (when no measured curve).
        bandwidth_efficiency: achievable fraction of `memory_bandwidth`.
        gemm_flops: measured GEMM FLOP/s by rows (tokens) per dtype: {dtype: [[rows, FLOP/s], ...]}; interpolated
            in log(rows), used instead of `peak_flops * flops_efficiency` when present.
        attention_flops: measured attention FLOP/s by query rows per dtype (same form), else the GEMM rate.
        elementwise_bandwidth: effective bandwidth of the elementwise ops (norms, RoPE, activations; bytes/s), else
            the memory bandwidth.
        elementwise_curve: measured elementwise bandwidth by rows per dtype (same form as `gemm_flops`; on a CPU the
            rate falls once a step's activations outgrow the L2 cache); used instead of `elementwise_bandwidth`.
        gather_bandwidth: effective rate (bytes the cost model counts per second) of the CPU runner's batched decode
            attention, which gathers the pages of decode rows whose keys span several pages; None: the roofline.
        past_attention_flops: the CPU runner's prefill attention over a past (page gather + masked attention) priced
            as ``past_attention_call_s + keys * past_attention_key_s + FLOPs / past_attention_flops`` per call;
            None: as other prefill chunks (the roofline at `attention_flops`).
        past_attention_key_s: seconds per key (past + chunk) of such a call.
        past_attention_call_s: fixed seconds of such a call.
        decode_kernel_bandwidth: effective rate (bytes the cost model counts per second: each decode row's K/V, query,
            output and new K/V, `cbnb.sim.cost.decode_kernel_bytes`) of the CPU runner's compiled paged-decode kernel
            (`cbnb.runner.cpu.cpu_kernels`, float32 only), which computes every decode row of a layer in one call reading
            the pages in place; None: the kernel is not modelled (the runner's torch path: per-row calls and the
            page gather).
        decode_kernel_call_s: fixed seconds of one call of that kernel (one per layer) beyond its bytes.
        prefill_kernel_flops: FLOP/s (causal: ``4 H d`` per query-key pair read) of the CPU runner's compiled
            prefill kernel (`cbnb.runner.cpu.cpu_kernels.paged_prefill`, float32 only), which computes every prefill chunk
            of a full-attention layer in one call over the pages; a layer's chunks cost ``prefill_kernel_call_s +
            FLOPs / prefill_kernel_flops``. None: not modelled (the per-chunk torch path: `attention_flops` and the
            `past_attention_*` figures).
        prefill_kernel_call_s: fixed seconds of one call of that kernel (one per layer with prefill chunks).
        decode_kernel_shared_bandwidth: the same kernel's rate over keys in blocks an earlier row of the step read
            already (a shared prefix, then in the CPU's caches: `cbnb.core.plan.StepWork.shared_tokens`); None: as
            `decode_kernel_bandwidth`.
        threads: CPU threads the figures were measured with; the decode kernel's thread imbalance (few rows: fewer
            (row, KV head) items than threads can share evenly) is modelled with it. None: not modelled.
        cost_factors: multipliers of the cost model's groups, measured end to end (`cbnb.measure.calibrate` runs
            `cbnb.Engine` on a random-weight model of the shape and fits them to its step times): "compute" (linear,
            elementwise, LM head, sampling; a number, or a curve ``[[rows, factor], ...]`` over the step's query
            tokens, interpolated in log rows), "attention" (prefill chunks), "decode_attention" (decode rows) and
            "fixed" (host work and launches). None: all 1.
        reserved_bytes: device memory the engine cannot use (CUDA context, allocator); subtracted before sizing.
        host_memory_bytes: host RAM available for the swap pool (None: unlimited).
        interconnect_bandwidth: the GPU-to-GPU link, one direction per GPU (bytes/s; NVLink, or PCIe without it), what
            a tensor-parallel group's all-reduces use (`cbnb.sim.fleet`); None: unknown (no TP simulation).
        interconnect_latency_s: fixed seconds of one all-reduce call over that link (None: unknown).
        allow_tf32: float32 GEMMs use the "tf32" rate (PyTorch's default is off).
        sources: citation per figure (URL, or how it was measured / assumed).
        notes: free text (e.g. the shape a measured profile was calibrated at).
        provenance: where the figures come from and how far to trust them (`trust()` fills the default): ``kind``
            "datasheet" (vendors' figures, assumed efficiencies and overheads: unverified), "custom" (made by hand),
            "calibrated" (measured
            on this machine by `cbnb.measure.calibrate`) or "fitted" (`cbnb.measure.fit_vllm.fit_profile`: efficiencies and
            step cost fitted to N ``vllm bench serve`` runs), with ``runs``, ``error_pct`` (the error on the runs
            it was fitted on / validated against), ``loo_error_pct`` (leave-one-out) and free ``details``.
    """

    name: str
    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    host_device_bandwidth: float
    step_overhead_s: float
    step_overhead_graph_s: float
    kernel_launch_s: float
    runner: str = "cuda"
    layer_overhead_s: float | None = None
    layer_kernels: int = 24
    attention_call_s: float | None = None
    request_overhead_s: float = 0.0
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    gemm_flops: Mapping[str, list] | None = None
    attention_flops: Mapping[str, list] | None = None
    elementwise_bandwidth: float | None = None
    elementwise_curve: Mapping[str, list] | None = None
    gather_bandwidth: float | None = None
    past_attention_flops: float | None = None
    past_attention_key_s: float = 0.0
    past_attention_call_s: float = 0.0
    decode_kernel_bandwidth: float | None = None
    decode_kernel_call_s: float = 0.0
    decode_kernel_shared_bandwidth: float | None = None
    prefill_kernel_flops: float | None = None
    prefill_kernel_call_s: float = 0.0
    threads: int | None = None
    cost_factors: Mapping[str, float] | None = None
    reserved_bytes: int = 0
    host_memory_bytes: int | None = None
    interconnect_bandwidth: float | None = None
    interconnect_latency_s: float | None = None
    allow_tf32: bool = False
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def calibrated_for(self) -> tuple[str, str] | None:
        """(shape name, dtype) a calibrated profile was measured at (`cbnb.measure.calibrate` records them in
        ``provenance["details"]``; older files only in their notes), or None when unknown or not calibrated."""
        d = dict((self.provenance or {}).get("details") or {})
        if d.get("shape"):
            return str(d["shape"]), str(d.get("dtype") or "")
        m = re.search(r"calibrated at shape (\S+) \(([^)]+)\)", self.notes or "")
        return (m.group(1), m.group(2)) if m else None

    def trust(self, shape: Any = None, dtype: Any = None) -> dict[str, Any]:
        """The profile's provenance (see the attribute), with the default when none was recorded: a GPU profile is
        "datasheet" (no error known), a profile `cbnb.measure.calibrate` measured (its sources say so) "calibrated"
        with the errors of the last published ``python -m cbnb.measure.validate`` (`VALIDATION`), any other (made by
        hand) "custom" (no error known). Keys: kind, runs, error_pct, loo_error_pct, what (a
        sentence saying what the prediction can be trusted for), details.

        With `shape` (a name or `ModelShape`) and `dtype`: a profile calibrated at another model or dtype keeps kind
        "calibrated" but loses its error (``error_pct`` None: the validation was of the model it was calibrated at),
        ``details["other_model"]`` says which it was measured at, and ``what`` says to calibrate at this one."""
        prov = dict(self.provenance or {})
        measured = any(str(v).startswith(CALIBRATED_PREFIXES) for v in dict(self.sources).values())
        kind = prov.get("kind") or ("calibrated" if measured else "datasheet" if self.kind == "gpu" else "custom")
        if kind not in TRUST_TEXT:
            raise ValueError(f"HardwareProfile.provenance['kind'] must be one of {', '.join(TRUST_TEXT)}; got {kind!r}")
        out: dict[str, Any] = {"kind": kind, "runs": prov.get("runs"), "error_pct": prov.get("error_pct"),
                               "loo_error_pct": prov.get("loo_error_pct"), "details": prov.get("details", {})}
        if kind == "calibrated" and out["error_pct"] is None:
            out["error_pct"] = VALIDATION["wall_error_pct_max"]
            out["details"] = {**VALIDATION, **out["details"]}
        out["what"] = TRUST_TEXT[kind]
        if kind == "fitted" and (out["details"] or {}).get("public"):
            out["what"] = TRUST_TEXT["fitted-public"]
        at = self.calibrated_for() if kind == "calibrated" and shape is not None else None
        if at is not None:
            name = getattr(shape, "name", shape)
            dt = normalize_dtype(dtype if dtype is not None else getattr(shape, "dtype", at[1]))
            if (str(name), dt) != (at[0], normalize_dtype(at[1]) if at[1] else dt):
                out["error_pct"] = None
                out["details"] = {**out["details"], "other_model": f"{at[0]} ({at[1]})", "used_for": f"{name} ({dt})"}
                out["what"] = (f"calibrated on this CPU at {at[0]} ({at[1]}), used here for {name} ({dt}): the "
                               "validation error does not carry over to another model or dtype, so these figures are "
                               f"unverified; run cbnb.measure.calibrate({str(name)!r}) to calibrate at this model")
        if (out["details"] or {}).get("busy"):
            out["what"] += ("; MEASURED ON A BUSY MACHINE (load average "
                            f"{out['details'].get('load_average_before')}): recalibrate when it is idle")
        return out

    def error_band(self, shape: Any = None, dtype: Any = None) -> str:
        """The one-line trust band every simulated figure on this profile carries: "±6 % on 6 held-out public
        points" (fitted to public vLLM points, `cbnb.measure.public`), "±3 % leave-one-out on 4 vLLM runs" (fitted
        to yours), "calibrated here: ±15 % wall time in the last validation", "datasheet: unverified", or
        "... not this model: unverified" for a CPU profile calibrated at another model (`trust` with `shape`)."""
        t = self.trust(shape, dtype) if shape is not None else self.trust()
        err = t.get("loo_error_pct") if t.get("loo_error_pct") is not None else t.get("error_pct")
        if t["kind"] == "fitted" and err is not None:
            if (t.get("details") or {}).get("public"):
                return f"±{err:.0f} % on {t.get('runs')} held-out public points"
            return f"±{err:.0f} % leave-one-out on {t.get('runs')} vLLM runs"
        if t["kind"] == "calibrated":
            if (t.get("details") or {}).get("other_model"):
                return f"calibrated at {t['details']['other_model']}, not this model: unverified"
            return f"calibrated here: ±{err:.0f} % wall time in the last validation" if err is not None else \
                "calibrated here"
        return "datasheet: unverified" if t["kind"] == "datasheet" else f"{t['kind']} profile: unverified"

    def __post_init__(self) -> None:
        check_profile(self)

    # ------------------------------------------------------------------------------------------ rates
    @property
    def device_type(self) -> str:
        """The device type `ContinuousBatchingConfig.resolve` gets: "cuda" for a GPU profile, else "cpu"."""
        return "cuda" if self.kind == "gpu" else "cpu"

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (float32 falls back to "tf32" only with `allow_tf32`).

        Raises:
            ValueError: when the profile has no figure for `dtype`.
        """
        d = normalize_dtype(dtype)
        if d == "float32" and self.allow_tf32 and "tf32" in self.peak_flops:
            return self.peak_flops["tf32"]
        if d in self.peak_flops:
            return self.peak_flops[d]
        raise ValueError(f"profile {self.name!r} has no peak FLOP/s for {d}; it lists {', '.join(self.peak_flops)}")

    def gemm_rate(self, dtype: str, rows: int) -> float:
        """Effective GEMM FLOP/s at `rows` rows (tokens): the measured curve if any, else peak * efficiency."""
        return self._curve(self.gemm_flops, dtype, rows) or self.peak(dtype) * self.flops_efficiency

    def attention_rate(self, dtype: str, rows: int) -> float:
        """Effective attention FLOP/s for a chunk of `rows` query rows."""
        return self._curve(self.attention_flops, dtype, rows) or self.gemm_rate(dtype, rows)

    @property
    def bandwidth(self) -> float:
        """Effective memory bandwidth (bytes/s)."""
        return self.memory_bandwidth * self.bandwidth_efficiency

    def elementwise_rate(self, dtype: str, rows: int) -> float:
        """Effective bandwidth (bytes/s) of the elementwise ops of a step with `rows` token rows."""
        return self._curve(self.elementwise_curve, dtype, rows, scale=False) or self.elementwise_bandwidth or \
            self.bandwidth

    @property
    def layer_launch_s(self) -> float:
        """Eager launch cost of one decoder layer outside attention (seconds)."""
        return self.layer_overhead_s if self.layer_overhead_s is not None else self.layer_kernels * self.kernel_launch_s

    @property
    def attention_call_cost_s(self) -> float:
        return self.attention_call_s if self.attention_call_s is not None else 2 * self.kernel_launch_s

    def free_bytes(self, weight_bytes: int) -> int:
        """Device memory left for the engine once the weights are loaded (what the engine measures as free)."""
        return int(self.memory_bytes - self.reserved_bytes - weight_bytes)

    @staticmethod
    def _curve(curves: Mapping[str, list] | None, dtype: str, rows: int, scale: bool = True) -> float | None:
        """Linear interpolation in log(rows); below the first point a FLOP rate scales with rows (the time of a
        weight-bound GEMM does not shrink with fewer rows), a bandwidth is held; beyond the last point it is held."""
        if not curves:
            return None
        pts = curves.get(normalize_dtype(dtype))
        if not pts:
            return None
        r = max(1.0, float(rows))
        x = math.log(r)
        xs = [math.log(p[0]) for p in pts]
        if x <= xs[0]:
            return pts[0][1] * r / pts[0][0] if scale else pts[0][1]
        if x >= xs[-1]:
            return pts[-1][1]
        for i in range(1, len(pts)):
            if x <= xs[i]:
                f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                return pts[i - 1][1] + f * (pts[i][1] - pts[i - 1][1])
        return pts[-1][1]  # pragma: no cover - unreachable

    # ------------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(v) if isinstance(v, Mapping) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    def save(self, path: str | os.PathLike | None = None) -> pathlib.Path:
        """Write the profile as JSON (default: ``profile_cache_dir() / f"{name}.json"``). Returns the path."""
        p = pathlib.Path(path) if path is not None else profile_cache_dir() / f"{self.name}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        """Build from `to_dict()` output or a bundled file (unknown keys are an error naming them)."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"unknown HardwareProfile field(s): {', '.join(extra)}")
        kw = dict(data)
        for f in ("memory_bytes", "reserved_bytes", "host_memory_bytes"):
            if kw.get(f) is not None:
                kw[f] = int(kw[f])
        return cls(**kw)

    def replace(self, **changes: Any) -> "HardwareProfile":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def load_profile(source: Any) -> HardwareProfile:
    """A `HardwareProfile` from a name (`PROFILE_NAMES`), a JSON path, a dict, or a profile (returned as is).

    ``"cpu"`` is the profile `cbnb.measure.calibrate()` saved for this machine.

    Raises:
        ValueError: an unknown name (the message lists the choices), a missing ``cpu`` calibration (the message says
            how to make one), or an invalid file.
    """
    if isinstance(source, HardwareProfile):
        return source
    if isinstance(source, Mapping):
        return HardwareProfile.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"cannot build a hardware profile from {type(source).__name__}: pass a name, a path or a dict")
    text = str(source)
    bundled = _DATA / f"{text}.json"
    if bundled.is_file():
        path = bundled
    elif text == "cpu":
        path = profile_cache_dir() / "cpu.json"
        if not path.is_file():
            raise ValueError("no 'cpu' profile on this machine yet: run cbnb.measure.calibrate() (about a minute), "
                             f"which saves it to {path}")
    else:
        path = pathlib.Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"unknown hardware profile {text!r}: choose one of {', '.join(PROFILE_NAMES)} or pass a "
                             "JSON file")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return HardwareProfile.from_dict(data)


# Substrings of torch.cuda.get_device_name() -> the bundled profile of that part (first match wins).
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("4090", "rtx-4090"),
                 ("L40", None), ("L4", "l4"))


def profile_for_device(device_name: str) -> str | None:
    """The bundled profile for a CUDA device name (``torch.cuda.get_device_name()``), or None when none matches.

    E.g. "NVIDIA H100 80GB HBM3" -> "h100-sxm", "NVIDIA H200" -> "h200", "NVIDIA L4" -> "l4"; an L40 or an
    unknown part -> None (make a profile for it: `HardwareProfile`, or calibrate on it). An H100 PCIe also maps
    to the SXM profile, whose datasheet figures are higher: check `load_profile("h100-sxm")` against your part.
    """
    name = str(device_name).upper()
    for key, profile in _DEVICE_NAMES:
        if key in name:
            return profile
    return None
