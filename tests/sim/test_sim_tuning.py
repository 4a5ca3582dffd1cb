"""The tuning lab on the simulator: `run_workload`, `sweep`, `best`, the run log and the Runs panel take a `SimEngine`
(its virtual `driver_clock`); the goodput heatmap of a sweep."""

from __future__ import annotations

import pytest

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.metrics import SLO
from cbnb.core.requests import RequestState
from cbnb.sim import SimEngine, load_shape
from cbnb.lab.heatmap import heatmap, heatmap_grid
from cbnb.telemetry.runs import provenance_text
from cbnb.lab.tuning import best, run_workload, sweep
from cbnb.lab.workloads import Workload, synthetic

from test_sim_engine import small_sim


def poisson(n=24, rate=40.0, seed=0):
    return synthetic("sim-poisson", n, tr.Poisson(rate), tr.LogNormal(48, 0.5, 8, 128), tr.LogNormal(8, 0.5, 2, 24),
                     vocab_size=1000, seed=seed)


def test_run_workload_drives_a_sim_on_its_virtual_clock():
    sim = small_sim()
    wl = poisson()
    run = run_workload(sim, wl, slo=SLO(ttft_s=0.5, tpot_s=0.1))
    recs = run.records
    assert all(r.finished for r in recs) and [r.output_tokens for r in recs] == wl.max_new_tokens
    # never early, never late: the driver is at each arrival instant on the simulated clock
    assert [r.submitted_s for r in recs] == pytest.approx([r.arrival_s for r in recs], abs=1e-12)
    assert all(r.queued_s == pytest.approx(r.arrival_s, abs=1e-12) for r in recs)
    assert all(r.ttft_s > 0 and r.e2e_s >= r.ttft_s for r in recs)
    assert run.engine == "sim-t-cpu" and list(sim.runs)[-1] is run
    assert run.metrics["steps"] == sim.stats()["run"]["steps"] > 0
    # the run's span is simulated seconds: it ends with the last request, after the last arrival
    assert run.metrics["requests_per_s"] == pytest.approx(len(recs) / run.metrics["duration_s"])
    assert max(r.finished_s for r in recs) == pytest.approx(run.metrics["duration_s"], rel=1e-6)


def test_a_request_arriving_during_a_step_waits_for_it_and_counts_from_its_arrival():
    # One long prefill (t in [0, d)), a second request arriving in the middle of it: the real engine takes it
    # from its inbox after the step, so its queue time is the rest of that step.
    sim = small_sim()
    sim.submit([40] * 60, 1, arrival_s=0.0)
    sim.run_until(1e-9)
    d = sim.steps[0].end_s
    mid = d / 2
    clock = sim.driver_clock
    clock.sleep_until(mid)
    assert clock.now() == mid and sim.now == d  # the caller is at mid; the step in flight ends at d
    h = sim.submit([41] * 8, 2)
    out = h.result()
    assert out.timings.queued == mid and out.timings.scheduled >= d
    with pytest.raises(ValueError, match="arrival_s"):
        sim.submit([41] * 8, 2, arrival_s=mid / 2)  # before the caller's present: refused, naming the field


def test_sweep_on_a_sim_records_every_run_and_reconfigure_and_is_deterministic():
    sim = small_sim()
    wl = poisson()
    res = sweep(sim, wl, {"page_size": [16, 32], "max_batch_tokens": [32, 128]}, repeats=2, progress=False,
                slo=SLO(ttft_s=0.05, tpot_s=0.1))
    assert len(res.runs) == 8 and [r.point for r in res.runs] == [0, 1, 2, 3] * 2
    assert [r.config["page_size"] for r in res.runs[:4]] == [16, 16, 32, 32]
    assert [r.config["max_batch_tokens"] for r in res.runs[:4]] == [32, 128, 32, 128]
    kinds = [e.kind for e in sim.runs]
    assert kinds.count("reconfigure") == 8 and kinds.count("run") == 8  # the sim records its own reconfigures
    # a simulation is deterministic: the repeat of each point gives the same figures
    for a, b in zip(res.runs[:4], res.runs[4:]):
        assert a.metrics.keys() == b.metrics.keys()
        for k, v in a.metrics.items():  # equal up to float rounding (the repeat runs later on the clock)
            assert v == pytest.approx(b.metrics[k], rel=1e-9, abs=1e-12), k
    # the points are told apart by the simulated scheduler (the budget changes how prefill is chunked)
    assert len({r.metrics["ttft_s_p50"] for r in res.runs[:4]}) > 1
    v = best(res, "ttft_s_p50")
    assert v.ranking[0][1] == pytest.approx(min(r.metrics["ttft_s_p50"] for r in res.runs))


def test_best_on_single_simulated_runs_says_they_are_deterministic():
    sim = small_sim()
    res = sweep(sim, poisson(12), {"max_batch_tokens": [32, 256]}, repeats=1, progress=False)
    text = best(res, "ttft_s_p50").text
    assert "deterministic" in text and "provisional" not in text


def heat_sweep():
    sim = small_sim()
    res = sweep(sim, poisson(12), {"page_size": [16, 32], "max_batch_tokens": [32, 128], "safety_margin": [0.0, 0.3]},
                repeats=1, progress=False, slo=SLO(ttft_s=0.05, tpot_s=0.1))
    return res


def test_heatmap_grid_puts_each_points_median_in_its_cell():
    res = heat_sweep()
    g = heatmap_grid(res, "page_size", "max_batch_tokens", "ttft_s_p50", facet="safety_margin")
    assert (g.xs, g.ys, g.facets) == ([16, 32], [32, 128], [0.0, 0.3])
    for r in res.runs:
        p = res.points[r.point]
        cell = g.facets.index(p["safety_margin"]), g.ys.index(p["max_batch_tokens"]), g.xs.index(p["page_size"])
        assert g.median[cell[0]][cell[1]][cell[2]] == r.metrics["ttft_s_p50"]
        assert g.runs[cell[0]][cell[1]][cell[2]] == 1
    lowest = min(res.runs, key=lambda r: r.metrics["ttft_s_p50"])  # lower TTFT is better
    assert g.best[3] == lowest.metrics["ttft_s_p50"]


def test_heatmap_grid_errors_name_the_field():
    res = heat_sweep()
    with pytest.raises(ValueError, match="x='num_blocks' is not set by every point.*page_size"):
        heatmap_grid(res, "num_blocks", "max_batch_tokens")
    with pytest.raises(ValueError, match=r"same cell: they differ in \['safety_margin'\]"):
        heatmap_grid(res, "page_size", "max_batch_tokens")  # safety_margin varies but is not on an axis
    with pytest.raises(ValueError, match="different fields"):
        heatmap_grid(res, "page_size", "page_size")


def test_heatmap_figure_shows_the_grid_one_panel_per_facet():
    pytest.importorskip("plotly")
    res = heat_sweep()
    g = heatmap_grid(res, "page_size", "max_batch_tokens", facet="safety_margin")
    fig = heatmap(res, "page_size", "max_batch_tokens", facet="safety_margin")
    maps = [t for t in fig.data if t.type == "heatmap"]
    assert len(maps) == 2
    for t, z in zip(maps, g.median):
        assert [list(row) for row in t.z] == z
        assert list(t.x) == ["16", "32"] and list(t.y) == ["32", "128"]
    marker = [t for t in fig.data if t.type == "scatter"]
    assert len(marker) == 1 and list(marker[0].x) == [str(g.best[2])] and list(marker[0].y) == [str(g.best[1])]
    assert "best:" in fig.layout.title.text and "goodput" in fig.layout.title.text


def test_runs_panel_shows_a_simulated_sweep_and_exports_it_for_the_shapes_model():
    from cbnb.ui.runs_panel import RunsPanel

    sim = SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(max_memory_percent=0.3))
    wl = synthetic("prod", 20, tr.Poisson(10.0), tr.Fixed(256), tr.Fixed(16), vocab_size=128256)
    sweep(sim, wl, {"page_size": [16, 64]}, repeats=1, progress=False)
    panel = RunsPanel(sim, autostart=False)
    try:
        panel.refresh()
        rows = [r for r in panel.rows if r["engine"] == "sim-h100-sxm"]
        assert sorted(r["change"] for r in rows) == ["page_size=16", "page_size=64"]
        key = next(r["key"] for r in rows if r["change"] == "page_size=16")
        panel.select(key)
        text = panel.export("vllm")
        assert "meta-llama/Llama-3.1-8B" in text and "--block-size 16" in text
    finally:
        panel.close()


def test_production_scale_shape_on_a_gpu_profile_sweeps_through_the_lab():
    # llama-3.1-8b / H100 (bf16, async batching, CUDA graphs): a small grid through the same helpers
    sim = SimEngine(load_shape("llama-3.1-8b"), "h100-sxm", ContinuousBatchingConfig(max_memory_percent=0.3))
    assert sim.async_batching
    wl = synthetic("prod", 40, tr.Poisson(20.0), tr.LogNormal(512, 0.5, 16, 2048), tr.LogNormal(64, 0.5, 4, 256),
                   vocab_size=128256)
    res = sweep(sim, wl, {"page_size": [16, 256], "max_batch_tokens": [512, 8192]}, repeats=1, progress=False,
                slo=SLO(ttft_s=0.2, tpot_s=0.02))
    assert all(all(r.finished for r in run.records) for run in res.runs)
    g = heatmap_grid(res, "page_size", "max_batch_tokens")
    assert all(v is not None for row in g.median[0] for v in row)
    # the budget reaches the core's scheduler: 512 query tokens a step chunk the longer prompts into more steps
    small, big = (next(r for r in res.runs if r.config["max_batch_tokens"] == b and r.config["page_size"] == 16)
                  for b in (512, 8192))
    assert max(map(len, wl.prompts)) > 512
    assert small.metrics["steps"] > big.metrics["steps"]


def test_workload_of_text_prompts_is_refused_by_the_sim_per_request():
    # A SimEngine has no tokenizer: text prompts are refused at submit (recorded FAILED), the run goes on.
    sim = small_sim()
    wl = Workload("mixed", "none", ["hello", [40] * 8], [2, 2], arrival_s=[0.0, 0.1])
    with pytest.warns(UserWarning, match="1 of 2 requests of workload 'mixed' FAILED.*no tokenizer"):
        run = run_workload(sim, wl)
    assert [r.state for r in run.records] == ["FAILED", "FINISHED"]
    assert "submit refused" in run.records[0].error



def test_compare_runs_and_figure_predicted_against_measured():
    from cbnb.lab.compare import compare_figure, compare_runs

    wl = poisson(12)
    a = run_workload(small_sim(), wl, log=False)
    slow = small_sim()
    slow.reconfigure(ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=16))  # other plans
    b = run_workload(slow, wl, log=False)
    rows = {r["figure"]: r for r in compare_runs(a, b)}
    r = rows["ttft_s_p50"]
    assert r["predicted"] == a.metrics["ttft_s_p50"] and r["measured"] == b.metrics["ttft_s_p50"]
    assert r["error"] == pytest.approx((r["predicted"] - r["measured"]) / r["measured"])
    assert rows["duration_s"]["label"] and "output_tokens_per_s" in rows
    with pytest.raises(ValueError, match="same workload"):
        compare_runs(a, run_workload(small_sim(), poisson(5), log=False))
    pytest.importorskip("plotly")
    fig = compare_figure(a, b)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["predicted (simulator)", "measured (engine)"]
    assert bars[0].y[0] == pytest.approx(1000 * a.metrics["ttft_s_p50"])
    dots = next(t for t in fig.data if t.name == "requests")
    assert len(dots.x) == 12 and dots.x[0] == pytest.approx(b.records[0].e2e_s)
    assert dots.y[0] == pytest.approx(a.records[0].e2e_s)


def test_best_calls_points_with_equal_simulated_figures_a_tie():
    # page_size does not change the plans of a workload that never fills the cache: equal figures (up to float
    # rounding, the runs start at other clock readings), so no winner
    sim = small_sim()
    sim.reconfigure(ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=64))
    res = sweep(sim, poisson(6, rate=2.0), {"num_blocks": [256, 512]}, repeats=1, progress=False)
    a, b = (r.metrics["goodput_requests_per_s"] for r in res.runs)
    assert a == pytest.approx(b, rel=1e-12)
    v = best(res, "goodput_requests_per_s")
    assert v.tie and v.winner is None and v.tied_with
    assert v.text.startswith("Exact tie on goodput") and "deterministic simulation" in v.text, v.text


def test_an_unsorted_trace_is_driven_in_arrival_order_and_direct_out_of_order_submits_are_refused(tmp_path):
    from cbnb.lab.workloads import from_trace

    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 16, "output_tokens": 2}\n'
                    '{"arrival_s": 0.1, "prompt_tokens": 24, "output_tokens": 3}\n')
    wl = from_trace(path, vocab_size=1000)
    sim = small_sim()
    run = run_workload(sim, wl)  # trace rows need not be sorted: the driver submits in arrival order
    assert [r.state for r in run.records] == ["FINISHED", "FINISHED"]
    assert [r.submitted_s for r in run.records] == pytest.approx([0.5, 0.1])
    direct = small_sim()
    direct.submit(wl.prompts[0], 2, arrival_s=0.5)
    with pytest.raises(ValueError, match=r"arrival_s=0\.1 is before the previous request's arrival_s=0\.5"):
        direct.submit(wl.prompts[1], 3, arrival_s=0.1)


def test_a_simulations_story_and_the_controls_panel_steps_it():
    """`SimEngine.explain` tells a request's story as `Engine.explain` does; the dashboard's step-mode buttons step a
    simulation one scheduling step per click (the shared step mode, `cbnb.engine.step_mode`)."""
    from cbnb.sim import SimEngine
    from cbnb.ui.controls import ControlsPanel

    sim = SimEngine("qwen3-0.6b", "h100-sxm")
    h = sim.submit(list(range(100, 164)), 4)
    sim.run()
    story = sim.explain(h.request_id)
    assert "FINISHED" in story.text() and story.entries
    panel = ControlsPanel(sim, autostart=False)
    try:
        panel.pause()
        assert sim.paused and "no step mode" not in panel.message
        h2 = sim.submit(list(range(100, 110)), 2)
        before = len(sim.events.events("step_planned"))
        assert panel.step(wait=True) is True and not panel.stepping
        assert len(sim.events.events("step_planned")) == before + 1 and not h2.done()
        panel.resume()
        assert not sim.paused
        assert h2.result().state == RequestState.FINISHED
    finally:
        panel.close()


def test_the_submit_panels_workload_button_runs_on_a_simulation_and_starts_a_run_segment():
    """The dashboard's workload button on a `SimEngine`: `reset_stats(label, cause=...)` as on `Engine` (a
    `RunStarted` marker the plots segment at), then every request submitted and finished in simulated time."""
    from cbnb.ui.submit import SubmitPanel

    sim = small_sim()
    panel = SubmitPanel(sim)
    try:
        handles = panel.run_workload("cpu-32", 0.25)
        assert panel.message_kind == "ok" and panel.message.startswith("Submitted workload cpu-32"), panel.message
        marks = sim.events.events("run_started")
        assert [(m.cause, m.label) for m in marks] == [("workload", "workload cpu-32 (scale 0.25)")]
        sim.run()
        ended = {o.request_id: o.state for o in sim.outputs()}
        assert handles and all(ended[h.request_id] == RequestState.FINISHED for h in handles)
    finally:
        panel.close()
    sim.reset_stats(marker=False)
    assert len(sim.events.events("run_started")) == 1 and sim.stats()["run"]["steps"] == 0
