"""Load sweeps and the knee: closed-loop and open-loop curves on the simulator, a tiny one on the real engine, and
the plot with both side by side."""

from __future__ import annotations

import pytest

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.load_sweep import knee, load_sweep, plot_load
from cbnb.sim import SimEngine
from cbnb.lab.workloads import synthetic


def test_knee_threshold_and_kneedle_on_a_hockey_stick():
    x = [100, 200, 300, 400, 450, 470]
    y = [1.0, 1.1, 1.3, 1.9, 4.0, 12.0]
    assert knee(x, y) == 3  # last point within 2x of the lowest load's 1.0
    assert knee(x, y, k=1.2) == 1
    assert knee(x, y, method="kneedle") == 3  # furthest below the chord once normalised
    assert knee(x[:4], [1.0, 1.5, None, 1.6]) == 1  # a point without figures ends the usable curve
    assert knee([1], [1.0]) is None
    with pytest.raises(ValueError, match="method"):
        knee(x, y, method="elbow")
    with pytest.raises(ValueError, match="k must"):
        knee(x, y, k=1.0)


def _sim():
    return SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(max_memory_percent=0.3))


WL = synthetic("ls", 48, tr.Offline(), tr.LogNormal(400, 0.5), tr.LogNormal(40, 0.5, 4, 128),
               vocab_size=128000, seed=2)


def test_sim_concurrency_sweep_rises_then_saturates_and_marks_a_knee():
    curve = load_sweep(_sim(), WL, concurrencies=[1, 4, 16, 48])
    pts = curve.points
    assert curve.kind == "concurrency" and [p["load"] for p in pts] == [1, 4, 16, 48]
    tput = [p["output_tokens_per_s"] for p in pts]
    assert tput == sorted(tput) and tput[-1] > 3 * tput[0]  # batching pays
    ttft = [p["ttft_s_p99"] for p in pts]
    assert ttft[-1] > ttft[0]  # queueing shows up in the tail
    assert curve.knee_index is not None and curve.knee_rule == {"method": "threshold", "k": 2.0,
                                                                "figure": "ttft_s_p99"}
    base = ttft[0]
    kp = curve.knee_index
    assert ttft[kp] <= 2 * base and (kp == len(pts) - 1 or ttft[kp + 1] > 2 * base)
    for run, c in zip(curve.runs, [1, 4, 16, 48]):
        assert run.workload["max_concurrency"] == c and run.metrics["requests_finished"] == 48
    assert curve.provenance["kind"] == "fitted"  # h100-sxm: fitted to the public vLLM points
    df = curve.frame()
    assert list(df["knee"]).count(True) == 1 and len(df) == 4


def test_sim_rate_sweep_is_open_loop():
    curve = load_sweep(_sim(), WL, rates=[2.0, 50.0])
    assert curve.kind == "rate"
    for run, r in zip(curve.runs, [2.0, 50.0]):
        assert run.workload["arrivals"] == {"kind": "poisson", "rate": r} and run.workload["max_concurrency"] is None
    with pytest.raises(ValueError, match="exactly one"):
        load_sweep(_sim(), WL)
    with pytest.raises(ValueError, match="concurrencies"):
        load_sweep(_sim(), WL, concurrencies=[0])


def test_real_and_sim_curves_side_by_side():
    import cbnb
    from helpers_engine import TIMEOUT, config, tiny_model, torch_threads

    wl = synthetic("ls-real", 6, tr.Offline(), tr.Uniform(8, 24), tr.Uniform(3, 6), vocab_size=512, seed=4)
    with torch_threads(1):
        eng = cbnb.Engine(tiny_model("tiny:llama"), config=config(page_size=16))
        with eng:
            c0 = eng.events.cursor
            real = load_sweep(eng, wl, concurrencies=[1, 3], timeout=TIMEOUT)
            warm, c1, _ = eng.events.since(c0)
            cold = load_sweep(eng, wl, concurrencies=[1], timeout=TIMEOUT, warmup=False)
            unwarmed = eng.events.since(c1)[0]
    assert real.engine == "cbnb" and all(r.metrics["requests_finished"] == 6 for r in real.runs)
    assert [r.workload["max_concurrency"] for r in real.runs] == [1, 3]
    # one warm-up request per point, on its fresh cache, outside the run (the runs hold exactly the workload's six)
    assert sum(e.kind == "request_added" for e in warm) == 2 * (6 + 1)
    assert sum(e.kind == "request_added" for e in unwarmed) == 6  # warmup=False: the workload's six only
    assert all(r.metrics["requests_finished"] == 6 for r in cold.runs)
    sim = load_sweep(_sim(), WL, concurrencies=[1, 4])
    fig = plot_load(real, sim)
    names = {t.name for t in fig.data}
    assert {"cbnb p50", "cbnb p99", "sim-h100-sxm p50", "sim-h100-sxm p99"} <= names
    stars = [t for t in fig.data if t.marker.symbol == "star"]
    assert len(stars) == 4  # one knee per curve on each of the two panels
    assert "knee" in fig.layout.title.text


def test_command_line_writes_the_plot_and_the_points(tmp_path, capsys):
    import json

    from cbnb.lab.load_sweep import main

    html, js = tmp_path / "k.html", tmp_path / "k.json"
    assert main(["--workload", "cpu-poisson", "--scale", "0.25", "--concurrencies", "1,4", "--profile", "h100-sxm",
                 "--html", str(html), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "load average before" in out and "knee at concurrency" in out and html.stat().st_size > 1000
    curves = json.loads(js.read_text())
    assert [p["load"] for p in curves[0]["points"]] == [1, 4] and curves[0]["provenance"]["kind"] == "fitted"
