"""Public vLLM measurements as points the simulator can replay, and the GPU profiles fitted to them (torch-free).

The points (``cbnb/sim/data/public/vllm_points.json``): each one measured by someone else and published, with its
source address, model, GPU, precision, engine version and settings, and the figures as read there. Two kinds:

``latency``  ``vllm bench latency``: one batch of ``batch_size`` requests of ``input_len`` prompt tokens generating
             ``output_len`` tokens each, all submitted together; figure ``latency_s`` (the batch's end-to-end time).
``serve``    a ``vllm bench serve`` / ``benchmark_serving.py`` run whose per-request lengths were published;
             figures ``duration_s``, ``ttft_s_p50`` and ``tpot_s_p50`` (vLLM's TPOT: a request's time after its first
             token over its tokens after the first). Requests that returned no token are left out of the replay.

A point replays on `SimEngine` with the shape and the GPU's profile it names (prompts of random ids, EOS ignored),
as `cbnb.measure.fit_vllm.predict` replays a ``vllm bench serve`` file: `PublicPoint` has the same interface
(``path``, ``measured``, ``workload()``, ``max_concurrency``) plus ``replay_on(profile)``, which swaps in the
point's own shape and GPU.

The fit (`fit_public`): the compute and bandwidth efficiencies and the fixed step cost of `cbnb.measure.fit_vllm`,
shared by the three GPU profiles (each keeps its own datasheet peaks, memory and bandwidth) and found over every
point at once, because one software stack reaches about the same fraction of each part's datasheet and no GPU has
enough points alone; leave-one-out refits without each point and predicts it. ``python -m cbnb.measure.validate
--gpu`` prints the table; ``--save`` writes the fit into the bundled profiles (their factors, sources and
provenance).
"""

from __future__ import annotations

import json
import pathlib
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["PublicPoint", "load_points", "predict_point", "fit_public", "save_fit", "PublicFit", "POINTS_PATH",
           "RESULT_PATH", "GPUS"]

POINTS_PATH = pathlib.Path(__file__).resolve().parents[1] / "sim" / "data" / "public" / "vllm_points.json"
#: The bundled profiles the public points cover.
GPUS = ("h100-sxm", "h200", "a100-80gb")
_KINDS = ("latency", "serve")


@dataclass
class PublicPoint:
    """One published measurement (the fields of ``vllm_points.json``; ``source`` is its address)."""

    id: str
    gpu: str
    shape: str
    dtype: str
    kind: str
    measured: dict[str, float]
    source: str
    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int | None = None

    @property
    def path(self) -> str:  # fit_vllm names a run by its path
        return self.id

    def replay_on(self, profile: Any) -> tuple[str, Any, str]:
        """(shape, profile, dtype) to replay on: the point's own GPU profile carrying `profile`'s fitted factors
        (the fit shares them across GPUs); `profile` itself when it is that GPU's."""
        from ..sim.profiles import load_profile

        prof = load_profile(profile)
        if prof.name != self.gpu and not prof.name.startswith(self.gpu + "-fitted"):
            prof = load_profile(self.gpu).replace(**{k: getattr(prof, k) for k in _FACTORS})
        return self.shape, prof, self.dtype

    def workload(self, vocab_size: int, seed: int = 0) -> Any:
        """The replay: the point's lengths (requests with no output left out), all arriving at 0."""
        from ..lab.workloads import FIRST_ID, Workload

        rng = random.Random(f"public:{self.id}:{seed}")
        pairs = [(i, o) for i, o in zip(self.input_lens, self.output_lens) if o > 0]
        prompts = [[rng.randrange(FIRST_ID, vocab_size) for _ in range(n)] for n, _ in pairs]
        return Workload(self.id, self.shape, prompts, [o for _, o in pairs], dtype=self.dtype,
                        traffic={"arrivals": {"kind": "public-point", "id": self.id}, "seed": seed})


def _point(d: dict[str, Any]) -> PublicPoint:
    for k in ("id", "gpu", "shape", "dtype", "kind", "measured", "source"):
        if k not in d:
            raise ValueError(f"{POINTS_PATH.name}: point {d.get('id', '?')!r} has no {k!r}")
    if d["kind"] not in _KINDS:
        raise ValueError(f"point {d['id']!r}: kind must be one of {', '.join(_KINDS)}; got {d['kind']!r}")
    if d["kind"] == "latency":
        n = int(d["batch_size"])
        ins, outs = [int(d["input_len"])] * n, [int(d["output_len"])] * n
        measured = {"duration_s": float(d["measured"]["latency_s"])}
    else:
        ins, outs = [int(x) for x in d["input_lens"]], [int(x) for x in d["output_lens"]]
        if len(ins) != len(outs):
            raise ValueError(f"point {d['id']!r}: input_lens and output_lens differ in length")
        measured = {k: float(v) for k, v in d["measured"].items()}
    info = {k: v for k, v in d.items() if k not in ("input_lens", "output_lens", "measured")}
    return PublicPoint(d["id"], d["gpu"], d["shape"], d["dtype"], d["kind"], measured, d["source"], ins, outs, info)


def load_points(path: str | pathlib.Path | None = None, gpus: Sequence[str] | None = None) -> list[PublicPoint]:
    """The public points (default: the bundled file), optionally only those on `gpus`.

    Raises:
        ValueError: a point lacks a field or has an unknown kind (the message names it).
    """
    data = json.loads(pathlib.Path(path or POINTS_PATH).read_text())
    pts = [_point(d) for d in data["points"]]
    return [p for p in pts if gpus is None or p.gpu in gpus]


_FACTORS = ("flops_efficiency", "bandwidth_efficiency", "step_overhead_s", "step_overhead_graph_s")


def predict_point(point: PublicPoint, profile: Any, config: Any = None) -> dict[str, float]:
    """The point's figures replayed on its own GPU with `profile`'s factors (`cbnb.measure.fit_vllm.predict`)."""
    from . import fit_vllm

    return fit_vllm.predict(point, point.shape, profile, config)


def _errors(pred: dict[str, float], meas: dict[str, float]) -> dict[str, float]:
    """Signed relative error per measured figure, percent; a run's throughput error is its duration's, inverted."""
    out = {}
    for k, m in meas.items():
        p = pred.get(k)
        out[k] = float("inf") if p is None or not p > 0 else 100.0 * (p / m - 1.0)
    return out


@dataclass
class PublicFit:
    """What `fit_public` found: the factors, and per point the measured and predicted figures with the error of
    the fitted profile and the leave-one-out error (the point predicted by a fit without it)."""

    factors: dict[str, float]
    rows: list[dict[str, Any]]
    evaluations: int

    @property
    def loo_abs_errors(self) -> list[float]:
        """|error| of every held-out figure (percent)."""
        return [abs(e) for r in self.rows for e in (r.get("loo_errors_pct") or {}).values()]

    @property
    def median_loo_pct(self) -> float:
        errs = self.loo_abs_errors
        return statistics.median(errs) if errs else float("nan")

    def band(self) -> dict[str, Any]:
        """The error band the fitted profiles carry: median |leave-one-out error| over the held-out figures."""
        return {"loo_error_pct": round(self.median_loo_pct, 1), "points": len(self.rows),
                "figures": len(self.loo_abs_errors)}

    def report(self) -> str:
        lines = ["fitted to %d public vLLM points (shared factors: %s)" % (len(self.rows), ", ".join(
            f"{k} {v:.4g}" for k, v in self.factors.items())),
                 f"{'point':<24} {'gpu':<10} {'figure':<11} {'measured':>10} {'fitted':>10} {'err':>7} "
                 f"{'held out':>10} {'LOO err':>8}"]
        for r in self.rows:
            for k, m in r["measured"].items():
                p, lp = r["predicted"].get(k), (r.get("loo_predicted") or {}).get(k)
                le = (r.get("loo_errors_pct") or {}).get(k)
                lines.append(f"{r['id']:<24} {r['gpu']:<10} {k:<11} {m:>10.4g} {_num(p):>10} "
                             f"{r['errors_pct'][k]:>+6.1f}% {_num(lp):>10} "
                             + (f"{le:>+7.1f}%" if le is not None else f"{'':>8}"))
        b = self.band()
        lines.append(f"median |leave-one-out error|: {b['loo_error_pct']:.1f} % over {b['figures']} held-out figures "
                     f"of {b['points']} points (target <= 15 %)")
        lines.append("sources:")
        lines += [f"  {r['id']}: {r['source']}" for r in self.rows]
        return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def fit_public(points: Sequence[PublicPoint] | None = None, *, base: str = "h100-sxm", config: Any = None,
               leave_one_out: bool = True, max_evals: int = 60) -> PublicFit:
    """Fit the shared factors to `points` (default: all bundled) with `cbnb.sim.fit_vllm`'s search.

    Returns:
        `PublicFit` (factors, per-point rows with ``measured``, ``predicted``, ``errors_pct`` and, with
        `leave_one_out`, ``loo_predicted`` and ``loo_errors_pct``).
    """
    from ..sim.profiles import load_profile
    from . import fit_vllm

    pts = list(points) if points is not None else load_points()
    if not pts:
        raise ValueError("no public points to fit")
    base_p = load_profile(base)
    x, preds, evals = fit_vllm._search(pts, pts[0].shape, base_p, config, None, max_evals)
    rows = [{"id": p.id, "gpu": p.gpu, "kind": p.kind, "source": p.source, "measured": dict(p.measured),
             "predicted": pr, "errors_pct": _errors(pr, p.measured)} for p, pr in zip(pts, preds)]
    if leave_one_out and len(pts) > 1:
        for i, p in enumerate(pts):
            xi, _, e = fit_vllm._search(pts[:i] + pts[i + 1:], p.shape, base_p, config, None, max_evals)
            evals += e
            lp = predict_point(p, fit_vllm._apply(base_p, xi), config)
            rows[i]["loo_predicted"] = lp
            rows[i]["loo_errors_pct"] = _errors(lp, p.measured)
    fitted = fit_vllm._apply(base_p, x)
    return PublicFit({k: getattr(fitted, k) for k in _FACTORS}, rows, evals)


#: The last fit written into the bundled profiles (``--save``): its per-point table, read by `error_band`'s users.
RESULT_PATH = POINTS_PATH.with_name("fit_result.json")


def save_fit(fit: PublicFit, gpus: Sequence[str] = GPUS, *, date: str | None = None) -> list[pathlib.Path]:
    """Write `fit` into the bundled profiles of `gpus` (their four factors, the factors' sources, and provenance
    kind "fitted" with the median |leave-one-out error| as ``loo_error_pct``) and its table into `RESULT_PATH`.

    Returns:
        the files written.
    """
    import time

    from ..sim import profiles as _profiles

    date = date or time.strftime("%Y-%m-%d")
    band = fit.band()
    fitted_errs = [abs(e) for r in fit.rows for e in r["errors_pct"].values()]
    src = (f"fitted by cbnb.measure.public (python -m cbnb.measure.validate --gpu --save, {date}) to {band['points']} "
           f"public vLLM points (cbnb/sim/data/public/vllm_points.json), one set of factors shared by "
           f"{', '.join(gpus)}; median |leave-one-out error| {band['loo_error_pct']:.1f} % over {band['figures']} "
           "held-out figures")
    prov = {"kind": "fitted", "runs": band["points"], "error_pct": round(statistics.median(fitted_errs), 1),
            "loo_error_pct": band["loo_error_pct"],
            "details": {"public": True, "figures": band["figures"], "date": date,
                        "result": "cbnb/sim/data/public/fit_result.json",
                        "command": "python -m cbnb.measure.validate --gpu"}}
    written = []
    for gpu in gpus:
        path = _profiles._DATA / f"{gpu}.json"
        d = json.loads(path.read_text())
        d.update({k: float(f"{v:.6g}") for k, v in fit.factors.items()})
        d["sources"] = {**d.get("sources", {}), **{k: src for k in _FACTORS}}
        d["provenance"] = prov
        path.write_text(json.dumps(d, indent=1) + "\n")
        written.append(path)
    RESULT_PATH.write_text(json.dumps({"date": date, "factors": fit.factors, "band": band, "evaluations": fit.evaluations,
                                       "rows": fit.rows}, indent=1) + "\n")
    return written + [RESULT_PATH]
