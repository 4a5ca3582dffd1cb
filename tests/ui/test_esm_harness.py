"""Front-end logic of the panels in headless Chromium, without Jupyter (see harness.py): drawing 100,000 blocks,
hover, keyboard on a slider, buttons and the messages they send. One browser for the module."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from .harness import mount, py_set, widget_state
from .lab import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def page():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (scripts/setup.sh --browser)")
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1000, "height": 1600})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.errors = errors
        yield pg
        browser.close()
    assert errors == [], errors


class _Eng:
    from cbnb.telemetry.events import EventLog

    events = EventLog(10)


@pytest.fixture(scope="module")
def tiny_engine():
    import cbnb
    from cbnb.engine.models import load_model

    model, _ = load_model("tiny:llama")
    return cbnb.Engine(model, None, cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64))


def sent(page):
    return page.evaluate("() => window.__h.sent")


def test_kvmap_draws_100k_blocks_and_hover_asks_for_owner(page):
    from helpers_ui import synthetic_snapshot  # tests/ is on sys.path (tests/conftest.py)

    from cbnb.ui.kvmap import KVPageMapPanel
    from cbnb.ui.poller import Frame

    panel = KVPageMapPanel(_Eng(), autostart=False)
    snap = synthetic_snapshot(100_000)
    panel._update(Frame(wall=time.time(), snapshot=snap))
    mount(page, panel)
    page.wait_for_selector(".cbnb-kvmap canvas")
    # Redraw time for a changed map of 100k blocks (the draw runs synchronously on change:cells).
    snap2 = synthetic_snapshot(100_000, seed=1)
    panel._update(Frame(wall=time.time(), snapshot=snap2))
    for cells in (panel.cells, snapshot_cells(snap), panel.cells):
        py_set(page, "cells", cells)  # drawn in the next animation frame
    times = page.evaluate("() => document.querySelector('.cbnb-kvmap').__cbnbDrawMs.slice(-3)")
    (ARTIFACTS / "kvmap_100k_draw_ms.json").write_text(json.dumps(times))
    print("kvmap 100k redraw ms", [round(t, 1) for t in times])
    assert np.median(times) < 250
    # Pixel check: the colour under a few blocks matches their state.
    info = page.evaluate("""() => { const c = document.querySelector('.cbnb-kvmap canvas');
        return {w: c.width, h: c.height}; }""")
    assert info["w"] > 0 and info["h"] > 0
    title = page.locator(".cbnb-kv-group-title").text_content()
    assert "99,998 blocks + 2 reserved padding" in title and "full_attention" in title
    legend = page.locator(".cbnb-kvmap .cbnb-legend").text_content()
    assert "reserved padding: 2" in legend
    # Hover block 5: the panel asks Python for its owner; the answer shows in the tooltip.
    canvas = page.locator(".cbnb-kvmap canvas")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + 1, box["y"] + 1)  # block 0
    hover = [m for m in sent(page) if m.get("kind") == "hover"][-1]
    assert hover["block"] == 0 and hover["group"] == 0
    reply = {"kind": "hover", "seq": hover["seq"], **panel.details(0, 0)}
    page.evaluate("(m) => window.__h.pySend(m)", reply)
    tip = page.locator(".cbnb-kv-tooltip").text_content()
    assert "block 0 · reserved" in tip and "owner" in tip and "padding block" in tip
    vis = [m for m in sent(page) if m.get("kind") == "visible"]
    assert vis and vis[-1]["on"] is True
    page.screenshot(path=str(ARTIFACTS / "harness-kvmap-100k.png"))


def b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def snapshot_cells(snap) -> bytes:
    from cbnb.ui.state import encode_kv

    return encode_kv(snap)[1]


def test_config_slider_keys_edit_values_and_apply_sends(page, tiny_engine):
    from cbnb.ui.config_panel import ConfigPanel

    panel = ConfigPanel(tiny_engine, autostart=False)
    mount(page, panel)
    slider = page.locator(".cbnb-config input[type=range][data-field=max_batch_tokens]")
    slider.focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    vals = page.evaluate("() => window.__h.data.values")
    assert vals["max_batch_tokens"] == 64 + 2 * 16
    assert page.evaluate("() => window.__h.saved.length") >= 2
    assert "1 change" in page.locator(".cbnb-config .cbnb-changed").text_content()
    assert "(now 64)" in page.locator(".cbnb-config-row[data-field=max_batch_tokens] .cbnb-config-value").text_content()
    # Python answers the edit with a new preview: simulate it, the bars and code follow.
    panel.values = vals
    py_set(page, "memory", panel.memory)
    py_set(page, "code", panel.code)
    assert "max_batch_tokens=96" in page.locator(".cbnb-config .cbnb-code").text_content()
    assert page.locator(".cbnb-memory .cbnb-mem-seg[data-part=kv_cache]").count() == 2
    assert page.locator(".cbnb-memory .cbnb-mem-seg[data-part=cuda_graphs]").count() == 0  # CPU: no graph memory
    gpu = {**panel.memory, "proposed": {**panel.memory["proposed"], "cuda_graphs": 3 << 28}}
    py_set(page, "memory", gpu)  # a CUDA engine's preview: the graphs' share is its own segment and legend entry
    assert page.locator(".cbnb-memory .cbnb-mem-seg[data-part=cuda_graphs]").count() == 1
    assert "CUDA graphs 0 B → 768.0 MiB" in page.locator(".cbnb-memory .cbnb-legend").text_content()
    py_set(page, "memory", panel.memory)
    page.locator(".cbnb-config .cbnb-apply").click()
    m = sent(page)[-1]
    assert m["kind"] == "apply" and m["values"]["max_batch_tokens"] == 96
    # An invalid preview disables Apply.
    py_set(page, "memory", {**panel.memory, "error": "page_size must be an integer >= 4"})
    assert page.locator(".cbnb-config .cbnb-apply").is_disabled()
    # On CPU the CUDA-only toggles are greyed out.
    assert "cbnb-inactive" in page.locator(".cbnb-config-row[data-field=use_cuda_graph]").get_attribute("class")


def test_submit_and_stream_buttons_send_messages(page, tiny_engine):
    from cbnb.ui.stream import TokenStreamPanel
    from cbnb.ui.submit import SubmitPanel

    sub = SubmitPanel(tiny_engine, autostart=False)
    mount(page, sub)
    page.locator(".cbnb-prompt").press_sequentially("Hi there")
    page.locator(".cbnb-max-new").fill("12")
    page.locator(".cbnb-submit-btn").click()
    first = sent(page)[-1]
    assert {k: v for k, v in first.items() if k != "nonce"} == {"kind": "submit", "prompt": "Hi there",
                                                                "max_new_tokens": 12, "temperature": 0}
    page.evaluate("(m) => window.__h.pySend(m)", {"kind": "submitted", "nonce": first["nonce"]})  # Python's answer
    page.locator(".cbnb-max-new").fill("")
    page.locator(".cbnb-prompt").press("Control+Enter")
    assert sent(page)[-1]["max_new_tokens"] is None  # Python answers with a message (see test_ui_panels)
    page.locator(".cbnb-workload-btn").click()
    assert sent(page)[-1] == {"kind": "workload", "name": "cpu-32", "scale": 0.25}
    py_set(page, "message_kind", "error")
    py_set(page, "message", "The prompt is empty")
    assert page.locator(".cbnb-message.cbnb-msg-error").text_content() == "The prompt is empty"

    st = TokenStreamPanel(tiny_engine, autostart=False)
    mount(page, st)
    assert page.locator(".cbnb-empty").is_visible()
    items = [{"id": "req-1", "state": "DECODING", "text": "Hello", "n": 2, "max": 8, "error": "", "reason": ""},
             {"id": "req-0", "state": "FAILED", "text": "", "n": 0, "max": None, "error": "too long", "reason": "error"}]
    py_set(page, "items", items)
    assert page.locator(".cbnb-stream-item[data-id=req-1] .cbnb-stream-text").text_content() == "Hello"
    assert "2/8 tokens" in page.locator(".cbnb-stream-item[data-id=req-1]").text_content()
    assert page.locator(".cbnb-stream-item[data-id=req-0] .cbnb-cancel").is_hidden()
    assert "error: too long" in page.locator(".cbnb-stream-item[data-id=req-0]").text_content()
    py_set(page, "items", [dict(items[0], text="Hello world", n=3), items[1]])
    assert page.locator(".cbnb-stream-item[data-id=req-1] .cbnb-stream-text").text_content() == "Hello world"
    page.locator(".cbnb-stream-item[data-id=req-1] .cbnb-cancel").click()
    assert sent(page)[-1] == {"kind": "cancel", "id": "req-1"}


def test_stream_token_hover_shows_logprob_and_alternatives(page, tiny_engine):
    from cbnb.core.requests import RequestOutput, RequestState, TokenLogprob
    from cbnb.ui.stream import TokenStreamPanel
    from cbnb.ui.state import TextTracker, stream_items

    lps = [TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.75))), TokenLogprob(7, -2.5, ((3, -0.5), (7, -2.5)))]
    out = RequestOutput("req-7", [1, 2], [5, 7], state=RequestState.DECODING, max_new_tokens=8, logprobs=lps)
    plain = RequestOutput("req-8", [1, 2], [4], state=RequestState.DECODING, max_new_tokens=8)
    scored = RequestOutput("req-9", [1, 2, 6], [4], state=RequestState.FINISHED, max_new_tokens=1,
                           prompt_logprobs=[None, TokenLogprob(2, -1.0, ((6, -0.5),)), TokenLogprob(6, -0.125, ())])
    st = TokenStreamPanel(tiny_engine, autostart=False)
    st.items = stream_items([out, plain, scored], TextTracker(None))
    mount(page, st)
    chips = page.locator(".cbnb-stream-item[data-id=req-7] .cbnb-lp-strip:not(.cbnb-lp-prompt) .cbnb-lp-tok")
    assert chips.all_text_contents() == ["5", "7"]
    for rid, strip in (("req-8", ".cbnb-lp-strip"), ("req-7", ".cbnb-lp-prompt"), ("req-8", ".cbnb-lp-prompt")):
        assert page.locator(f".cbnb-stream-item[data-id={rid}] {strip}").first.is_hidden()  # not asked for
        assert page.locator(f".cbnb-stream-item[data-id={rid}] {strip}").last.is_hidden()
    # Prompt logprobs: their own strip, labelled, one chip per scored prompt token (positions 1 and 2).
    prompt_strip = page.locator(".cbnb-stream-item[data-id=req-9] .cbnb-lp-prompt")
    assert prompt_strip.locator(".cbnb-lp-label").text_content() == "prompt"
    assert prompt_strip.locator(".cbnb-lp-tok").all_text_contents() == ["2", "6"]
    prompt_strip.locator(".cbnb-lp-tok").first.hover()
    tip = page.locator(".cbnb-lp-tip")
    page.wait_for_function("() => /^prompt token 1: \"2\"  logprob -1.000/.test("
                           "document.querySelector('.cbnb-lp-tip').textContent)")
    assert '"6"  -0.500' in tip.text_content()
    page.mouse.move(0, 0)
    chips.nth(1).hover()
    tip = page.locator(".cbnb-lp-tip")
    tip.wait_for(state="visible")
    text = tip.text_content()
    assert 'token 1: "7"  logprob -2.500 (p=0.0821)' in text
    assert 'alternatives:' in text and '"3"  -0.500 (p=0.607)' in text
    # The tip stays inside the panel, also for a chip near its right edge.
    inside = page.evaluate("""() => { const t = document.querySelector('.cbnb-lp-tip').getBoundingClientRect();
        const p = document.querySelector('.cbnb-stream').getBoundingClientRect();
        return t.left >= p.left - 1 && t.right <= p.right + 1; }""")
    assert inside
    page.screenshot(path=str(ARTIFACTS / "harness-stream-logprob-hover.png"))
    page.mouse.move(0, 0)
    tip.wait_for(state="hidden")


def test_board_shows_errors_and_admission_warnings(page, tiny_engine):
    from cbnb.core.requests import RequestOutput, RequestState
    from cbnb.ui.board import RequestBoardPanel
    from cbnb.ui.state import request_rows

    warn = "exceeds the KV cache: 40 prompt tokens + max_new_tokens=500 = 540 tokens, but it holds at most 64 tokens"
    outs = [RequestOutput("req-a", [1] * 40, [5] * 3, state=RequestState.DECODING, warning=warn, max_new_tokens=500,
                          processors=("repetition_penalty=1.2", "temperature=0.7", "top_p=0.9")),
            RequestOutput("req-b", [1] * 40, [5] * 25, state=RequestState.FINISHED, warning=warn,
                          finish_reason="cache_exhausted", max_new_tokens=500),
            RequestOutput("req-c", [1] * 9, [], state=RequestState.FAILED, error="boom", finish_reason="error")]
    board = RequestBoardPanel(tiny_engine, autostart=False)
    board.rows, board.counts, board.hidden = request_rows(outs)
    mount(page, board)
    page.wait_for_selector(".cbnb-board tr[data-id=req-a]")
    cell = page.locator(".cbnb-board tr[data-id=req-a] td.cbnb-col-error")
    assert cell.text_content().startswith("⚠ exceeds the KV cache") and "cbnb-warning" in cell.get_attribute("class")
    assert cell.get_attribute("title") == warn
    ended = page.locator(".cbnb-board tr[data-id=req-b] td.cbnb-col-error").text_content()
    assert ended.startswith("⚠ ended cache_exhausted: exceeds the KV cache")
    failed = page.locator(".cbnb-board tr[data-id=req-c] td.cbnb-col-error")
    assert failed.text_content() == "boom" and "cbnb-warning" not in (failed.get_attribute("class") or "")
    sampling = page.locator(".cbnb-board tr[data-id=req-a] td.cbnb-col-sampling")
    assert sampling.text_content() == "repetition_penalty=1.2 · temperature=0.7 · top_p=0.9"
    headers = page.locator(".cbnb-board th").all_text_contents()
    assert "sampling" in headers
    assert "error / warning" in headers and "warning" not in headers and "finish_reason" not in headers
    page.screenshot(path=str(ARTIFACTS / "harness-board-warnings.png"))


def test_plots_draw_six_charts_from_float32_series(page, tiny_engine):
    from cbnb.ui.plots import LivePlotsPanel, plotly_lib

    plots = LivePlotsPanel(tiny_engine, autostart=False)
    for i in range(240):
        plots._step_series.append({"step": i + 1, "prefill": (i * 7) % 64, "decode": 8, "budget": 64, "requests": 3,
                                   "skip_token_budget": i % 3})
    for i in range(600):
        plots._time_series.append({c: float((i * 13) % 97) for c in plots._time_series.columns} | {"t": i / 10})
    plots.steps = plots._step_series.arrays()
    plots.series = plots._time_series.arrays()
    plots.summary = {"steps": 240, "device": "cpu", "graphs_enabled": False, "graph_captures": 0,
                     "graph_replays": 0, "swaps": 0, "soft_resets": 0, "finished": 3, "prefix_hit_tokens": 0}
    lib = plotly_lib()
    mount(page, plots, models={lib.model_id: widget_state(lib)})
    page.wait_for_function("() => (document.querySelector('.cbnb-plot-grid') || {}).__cbnbDraws >= 6",
                           timeout=60_000)
    n = page.evaluate("() => document.querySelectorAll('.cbnb-plots .js-plotly-plot').length")
    assert n == 6
    x = page.evaluate("() => Array.from(document.querySelector('.cbnb-plots .js-plotly-plot').data[0].x)")
    assert x == pytest.approx([s - 0.5 for s in range(1, 241)] + [240.499])  # steps centred, the last one whole
    names = page.evaluate("() => document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1].data.map(t => t.name)")
    assert names == ["token budget"]  # only reasons that occurred
    text = page.locator(".cbnb-plots").text_content()
    assert "CUDA graphs: 0 captures, 0 replays (cpu: graphs off)" in text
    cost = page.evaluate("() => document.querySelector('.cbnb-plot-grid').__cbnbDrawAt.map(d => d[1])")
    # a failed capture (its shape runs eagerly) shows in the graph chart and the summary line
    py_set(page, "summary", {**plots.summary, "device": "cuda", "graphs_enabled": True, "graph_captures": 5,
                             "graph_replays": 40, "graph_capture_failures": 2})
    page.wait_for_function("() => document.querySelector('.cbnb-plots').textContent.includes("
                           "'CUDA graphs: 5 captures, 40 replays, 2 failed captures (those shapes run eagerly)')",
                           timeout=30_000)
    assert "CUDA graphs 5/40 (2 failed: eager)" in page.locator(".cbnb-plots").text_content()
    (ARTIFACTS / "plots_draw_ms.json").write_text(json.dumps(cost))
    page.screenshot(path=str(ARTIFACTS / "harness-plots.png"), full_page=True)


def test_plots_all_eight_reasons_have_distinct_colours_and_meanings(page, tiny_engine):
    from cbnb.ui.plots import LivePlotsPanel, plotly_lib
    from cbnb.ui.series import SKIP_REASONS

    plots = LivePlotsPanel(tiny_engine, autostart=False)
    for i in range(60):
        plots._step_series.append({"step": i + 1, "budget": 64, **{f"skip_{r}": (i + k) % 3
                                                                    for k, r in enumerate(SKIP_REASONS)}})
    plots.steps = plots._step_series.arrays()
    lib = plotly_lib()
    mount(page, plots, models={lib.model_id: widget_state(lib)})
    page.wait_for_function("() => (document.querySelector('.cbnb-plot-grid') || {}).__cbnbDraws >= 6",
                           timeout=60_000)
    traces = page.evaluate("""() => document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1].data.map(
        t => [t.name, t.fillcolor, t.hovertemplate])""")
    assert len(traces) == 8 and len({c for _n, c, _h in traces}) == 8, traces  # 8 reasons, 8 colours
    assert all(h == "%{y} left out" for _n, _c, h in traces)
    items = page.locator(".cbnb-reason-legend .cbnb-legend-item")
    assert items.count() == 8
    texts = items.all_text_contents()
    assert any(t.startswith("no free blocks: the KV cache has too few free blocks") for t in texts), texts
    assert items.first.get_attribute("title").startswith("change it with: ")
    page.screenshot(path=str(ARTIFACTS / "harness-plots-eight-reasons.png"), full_page=True)
    # With no left-out request, the empty chart keeps its neighbour's step axis (not 0-6).
    py_set(page, "steps", {**plots.steps, **{f"skip_{r}": np.zeros(60, np.float32).tobytes() for r in SKIP_REASONS}})
    page.wait_for_function("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot');
        return g[1].data.length === 0; }""", timeout=30_000)
    r0, r1 = page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot'))
        .slice(0, 2).map(g => g._fullLayout.xaxis.range)""")
    assert r0 == r1 and r1[0] < 2 and r1[1] > 59, (r0, r1)


def test_timeline_draws_256_requests_by_500_steps(page, tiny_engine):
    """Draw time of the request timeline at its bound (256 requests x 500 steps), in Chromium; and a hover."""
    from cbnb.telemetry.events import RequestAdded, StepPlanned
    from cbnb.ui.poller import Frame
    from cbnb.ui.timeline import TimelinePanel

    tl = TimelinePanel(tiny_engine, autostart=False)
    rids = [f"req-{r}" for r in range(256)]
    events = [RequestAdded(0, 0.0, r, 100, 32) for r in rids]
    for s in range(1, 501):
        k0 = s % 256
        taken = [(rids[(k0 + k) % 256], "prefill" if k < 3 else "decode", 16 * (k + 1) if k < 3 else 1, 0, 0)
                 for k in range(40)]
        rest = [rids[(k0 + k) % 256] for k in range(40, 256)]
        events.append(StepPlanned(s, 0.0, "fifo", taken, [
            ("token_budget", rest[:100], {"budget_tokens": 256, "left_tokens": 0}),
            ("no_free_blocks", rest[100:], {"needed_blocks": (2,), "available_blocks": (0,)})], [], 256, 256, 96,
            37))
    t0 = time.perf_counter()
    tl._update(Frame(wall=time.time(), events=events))
    py_ms = 1000 * (time.perf_counter() - t0)
    assert tl.num_steps == 500 and len(tl.cells) == 256 * 500
    page.set_viewport_size({"width": 1440, "height": 900})  # 500 columns of 2 px need a wide panel
    mount(page, tl)
    page.evaluate("() => { document.getElementById('root').style.width = '1300px'; }")
    page.wait_for_selector(".cbnb-timeline canvas")
    py_set(page, "view_steps", 500)  # every column: the most expensive view
    changed = bytearray(tl.cells)
    times = []
    for k in range(12):
        changed[k] = (changed[k] + 1) % 4
        py_set(page, "cells", bytes(changed))  # a new frame of all 256 x 500 cells
        times.append(page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbDrawMs.slice(-1)[0]"))
    t0 = time.perf_counter()
    for _ in range(10):
        tl.timeline.encode()
    encode_ms = 100 * (time.perf_counter() - t0)
    report = {"draw_ms": times, "draw_ms_median": float(np.median(times)), "python_fold_500_steps_ms": py_ms,
              "python_encode_ms": encode_ms}
    (ARTIFACTS / "timeline_256x500.json").write_text(json.dumps(report, indent=1))
    print("timeline 256x500", json.dumps({k: v for k, v in report.items() if k != "draw_ms"}))
    assert np.median(times) < 100  # one draw per poller tick (<= 10 Hz) must leave the page time for the rest
    geo = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbGeo")
    assert geo["shown"] == 500 and geo["rows"][-1] == "req-255"
    box = page.locator(".cbnb-tl-canvas").bounding_box()
    page.mouse.move(box["x"] + geo["gutter"] + geo["colW"] * 499 + 1, box["y"] + geo["h"] - geo["rowH"] / 2)
    hover = [m for m in sent(page) if m.get("kind") == "hover"][-1]
    assert hover["id"] == "req-255" and hover["step"] == 500
    page.evaluate("(m) => window.__h.pySend(m)", {"kind": "hover", "seq": hover["seq"],
                                                  **tl.details("req-255", 500)})
    tip = page.locator(".cbnb-tl-tooltip").text_content()
    assert "req-255 · step 500 · decode" in tip and "decode: 1 tokens (positions 0-0) of the step's 256" in tip
    # A cell of the bottom row that was left out for the token budget.
    step = next(st for st in range(500, 400, -1) if tl.details("req-254", st).get("reason") == "token_budget")
    page.mouse.move(box["x"] + geo["gutter"] + geo["colW"] * (step - 1) + 1, box["y"] + geo["h"] - geo["rowH"] * 1.5)
    hover = [m for m in sent(page) if m.get("kind") == "hover"][-1]
    assert hover["id"] == "req-254" and hover["step"] == step
    d = tl.details("req-254", step)
    page.evaluate("(m) => window.__h.pySend(m)", {"kind": "hover", "seq": hover["seq"], **d})
    tip = page.locator(".cbnb-tl-tooltip").text_content()
    assert f"step {step} · waiting" in tip and "left out: token budget" in tip and "budget 256 tokens, 0 left" in tip
    page.screenshot(path=str(ARTIFACTS / "harness-timeline-256x500.png"))
    page.set_viewport_size({"width": 1000, "height": 1600})


def test_runs_panel_table_compare_chart_and_export(page):
    """The Runs panel's front-end: rows with spread, ticking two rows (synced `selected`), the compare table,
    the chart's points and min-max bars, choosing another figure, and the Export button's message."""
    from helpers_ui import make_log  # tests/ is on sys.path (tests/conftest.py)

    from cbnb.ui.runs_panel import RunsPanel

    from fake_engine import FakeEngine

    eng = FakeEngine()
    eng.runs = make_log()
    panel = RunsPanel(eng, autostart=False)
    mount(page, panel)
    page.wait_for_selector(".cbnb-runs-table tbody tr")
    assert page.locator(".cbnb-runs-table tbody tr").count() == 4
    first = page.locator(".cbnb-runs-table tbody tr").first
    assert "1.10 [1.00–1.20]" in first.locator(".cbnb-fig-goodput_requests_per_s").text_content()
    # Chart: one point and one min-max bar per (series, x).
    assert page.locator(".cbnb-runs-chart circle.cbnb-runs-point").count() == 4  # cbnb: 16, 32, 64; hf-cb: 32
    assert page.locator(".cbnb-runs-chart line.cbnb-runs-bar").count() == 4
    xs = page.evaluate("() => Array.from(document.querySelectorAll('.cbnb-runs-xtick')).map(e => e.textContent)")
    assert xs == ["16", "32", "64"]
    # Tick rows 1 and 4: the front-end sets `selected`; Python's answer (its trait) draws the comparison.
    rows = page.locator(".cbnb-runs-table tbody tr")
    rows.nth(0).locator("input.cbnb-runs-check").check()
    rows.nth(3).locator("input.cbnb-runs-check").check()
    keys = page.evaluate("() => window.__h.data.selected")
    assert keys == [panel.rows[0]["key"], panel.rows[3]["key"]]
    panel.selected = keys
    py_set(page, "export_text", panel.export_text)
    compare = page.locator(".cbnb-runs-compare-table")
    assert compare.count() == 1
    good = compare.locator("tr[data-figure=goodput_requests_per_s]").text_content()
    assert "1.10 [1.00–1.20]" in good and "0.500" in good and "−" not in good[:3]
    assert "hf-cb" in compare.locator("th.cbnb-runs-b").text_content()
    # Another figure for the chart.
    page.locator("select.cbnb-runs-figure").select_option("ttft_s_p99")
    assert page.evaluate("() => window.__h.data.chart_figure") == "ttft_s_p99"
    # Export: the button asks Python for the chosen target.
    page.locator("select.cbnb-runs-target").select_option("vllm")
    page.locator(".cbnb-runs-export-btn").click()
    assert sent(page)[-1] == {"kind": "export", "target": "vllm"}
    panel.export("vllm")
    py_set(page, "export_text", panel.export_text)
    assert "--block-size 16" in page.locator(".cbnb-runs-export-text").text_content()
    page.screenshot(path=str(ARTIFACTS / "harness-runs.png"), full_page=True)
