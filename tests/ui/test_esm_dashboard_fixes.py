"""Front-end fixes of issue 20 in the ESM harness (headless Chromium, no Jupyter; see harness.py): the config panel's
rows (stable classes, number boxes with range errors, a log slider, wrapping at 2x), the timeline's prefill cells,
gutter and colours, the plots' newest bar and run labels, a double click on Submit, step-rate wording, the board's
paused state, and the notebooks' plotly template on a dark page."""

from __future__ import annotations

import itertools
import json
import math
import time

import pytest

from .harness import mount, py_set, widget_state
from .lab import ARTIFACTS
from .test_esm_harness import page, tiny_engine  # noqa: F401  (the module's browser page and tiny engine)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def sent(pg):
    return pg.evaluate("() => window.__h.sent")


def wait_js(pg, expr: str, arg=None, timeout_ms: int = 15_000):
    pg.wait_for_function(expr, arg=arg, timeout=timeout_ms)


def set_theme(pg, dark: bool) -> None:
    """What JupyterLab's theme switch does for the panels: body[data-jp-theme-light] (and a page background)."""
    pg.evaluate("""(d) => { document.body.dataset.jpThemeLight = d ? 'false' : 'true';
        document.body.style.background = d ? '#111111' : '#ffffff'; }""", dark)


def set_scale(pg, scale: float) -> None:
    """What the Controls panel's font slider does: --cbnb-scale on <html> and a cbnb:presentation event."""
    pg.evaluate("""(s) => { document.documentElement.style.setProperty('--cbnb-scale', String(s));
        globalThis.dispatchEvent(new CustomEvent('cbnb:presentation', { detail: { scale: s } })); }""", scale)


def lab_de(a, b) -> float:
    """CIE76 colour difference of two sRGB colours (0-255 triples)."""
    def lab(c):
        lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in c[:3]]
        x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
        y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
        z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883
        f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
        return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])
    return math.dist(lab(a), lab(b))


def contrast(a, b) -> float:
    def lum(c):
        lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in c[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted([lum(a), lum(b)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


RGB_JS = """(css) => { const m = /rgba?\\(([^)]+)\\)/.exec(css); return m ? m[1].split(',').map(Number) : null; }"""


# ---------------------------------------------------------------------------------------------- config panel
def config_panel(tiny_engine):
    from cbnb.ui.config_panel import ConfigPanel

    return ConfigPanel(tiny_engine, autostart=False)


def test_config_rows_keep_their_classes_across_refreshes(page, tiny_engine):
    panel = config_panel(tiny_engine)
    mount(page, panel)
    classes = ("() => Object.fromEntries(Array.from(document.querySelectorAll('.cbnb-config-row'))"
               ".map(r => [r.dataset.field, r.className]))")
    first = page.evaluate(classes)
    for k in range(4):  # every refresh (a Python update) used to flip the faded state of the non-CUDA rows
        py_set(page, "values", dict(panel.values))
        py_set(page, "memory", dict(panel.memory, text=f"refresh {k}"))
        assert page.evaluate(classes) == first
    assert "cbnb-inactive" not in first["page_size"] and "cbnb-inactive" not in first["max_batch_tokens"]
    assert "cbnb-inactive" in first["use_cuda_graph"] and "cbnb-inactive" in first["max_memory_percent"]


def test_config_number_boxes_take_exact_values_and_name_the_range(page, tiny_engine):
    panel = config_panel(tiny_engine)
    mount(page, panel)
    page.evaluate("() => { document.getElementById('root').style.width = '860px'; }")
    box = page.locator(".cbnb-config-num[data-field=max_batch_tokens]")
    assert box.input_value() == "64"
    box.fill("100")  # not a multiple of the slider's step of 16: typed exactly
    box.press("Enter")
    assert page.evaluate("() => window.__h.data.values.max_batch_tokens") == 100
    assert "(now 64)" in page.locator(".cbnb-config-row[data-field=max_batch_tokens] .cbnb-config-value").text_content()
    err = page.locator(".cbnb-config-row[data-field=max_batch_tokens] .cbnb-config-error")
    for bad, words in (("5000", "max_batch_tokens must be from 16 to 4,096; got 5000"),
                       ("12.5", "max_batch_tokens must be a whole number from 16 to 4,096; got 12.5"),
                       ("lots", 'max_batch_tokens must be a number from 16 to 4,096; got "lots"')):
        box.fill(bad)
        box.press("Enter")
        assert err.is_visible() and err.text_content() == words
        assert box.get_attribute("aria-invalid") == "true" and box.input_value() == bad  # kept for correction
        assert page.evaluate("() => window.__h.data.values.max_batch_tokens") == 100  # nothing sent
    box.fill("2528")
    box.press("Enter")
    assert err.is_hidden() and box.get_attribute("aria-invalid") is None
    assert page.evaluate("() => window.__h.data.values.max_batch_tokens") == 2528
    frac = page.locator(".cbnb-config-num[data-field=safety_margin]")
    frac.fill("0.6")
    frac.press("Enter")
    assert "safety_margin must be from 0.00 to 0.50; got 0.6" in page.locator(
        ".cbnb-config-row[data-field=safety_margin] .cbnb-config-error").text_content()
    # The slider: log-scaled over 16-4096 (256 sits in the middle) and wide enough to aim at.
    slider = page.locator(".cbnb-config input[type=range][data-field=max_batch_tokens]")
    assert slider.bounding_box()["width"] >= 110, slider.bounding_box()
    py_set(page, "values", dict(panel.values, max_batch_tokens=256))
    assert abs(int(slider.input_value()) - 500) <= 2
    slider.focus()
    page.keyboard.press("ArrowRight")  # keys step by the field's step, not by a log tick
    assert page.evaluate("() => window.__h.data.values.max_batch_tokens") == 272
    page.screenshot(path=str(ARTIFACTS / "harness-config-number-boxes.png"))


def _overlaps(a, b) -> bool:
    return a["x"] < b["x"] + b["width"] - 0.5 and b["x"] < a["x"] + a["width"] - 0.5 and \
        a["y"] < b["y"] + b["height"] - 0.5 and b["y"] < a["y"] + a["height"] - 0.5


def test_config_rows_wrap_at_2x_and_cut_no_value(page, tiny_engine):
    panel = config_panel(tiny_engine)
    page.set_viewport_size({"width": 1440, "height": 900})
    mount(page, panel, state=dict(widget_state(panel), values=dict(panel.values, max_batch_tokens=2528)))
    page.evaluate("() => { document.getElementById('root').style.width = '860px'; }")  # the dashboard's 60 %
    try:
        for scale in (1, 2):
            set_scale(page, scale)
            page.wait_for_function("(s) => getComputedStyle(document.documentElement).getPropertyValue('--cbnb-scale')"
                                   ".trim() === String(s)", arg=scale)
            boxes = page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-config-row')).filter(
                r => r.offsetParent !== null).map(r => ({field: r.dataset.field,
                  parts: Array.from(r.querySelectorAll('.cbnb-config-label, .cbnb-config-ctl > *, .cbnb-config-value'))
                    .map(e => { const b = e.getBoundingClientRect();
                      return {cls: e.className, x: b.x, y: b.y, width: b.width, height: b.height,
                              cut: e.scrollWidth > e.clientWidth + 1 && e.tagName !== 'INPUT',
                              text: e.textContent}; })}))""")
            flat = [(b["field"], p) for b in boxes for p in b["parts"] if p["width"] > 0]
            for (fa, a), (fb, b) in itertools.combinations(flat, 2):
                assert not _overlaps(a, b), (scale, fa, a["cls"], fb, b["cls"])
            assert not [p for _f, p in flat if p["cut"]], (scale, [p for _f, p in flat if p["cut"]])
            sliders = page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-config input[type=range]'))
                .filter(e => e.offsetParent !== null).map(e => e.getBoundingClientRect().width)""")
            assert sliders and min(sliders) >= 80 * scale * 0.9, (scale, sliders)
            root = page.evaluate("() => document.querySelector('.cbnb-config').getBoundingClientRect().right")
            assert max(p["x"] + p["width"] for _f, p in flat) <= root + 0.5
            sel = page.locator(".cbnb-config select[data-field=scheduler_type]")
            assert sel.evaluate("e => e.scrollWidth <= e.clientWidth + 1")
            page.screenshot(path=str(ARTIFACTS / f"harness-config-{scale}x.png"), full_page=True)
    finally:
        set_scale(page, 1)
        page.set_viewport_size({"width": 1000, "height": 1600})


# ---------------------------------------------------------------------------------------------- timeline
def timeline_panel(tiny_engine):
    from cbnb.telemetry.events import RequestAdded, StepPlanned
    from cbnb.ui.poller import Frame
    from cbnb.ui.series import SKIP_REASONS
    from cbnb.ui.timeline import TimelinePanel

    tl = TimelinePanel(tiny_engine, autostart=False)
    rids = ["req-p"] + [f"req-{r}" for r in SKIP_REASONS] + ["req-d"]
    events = [RequestAdded(0, 0.0, r, 100, 8) for r in rids]
    for s in range(1, 41):
        taken = [("req-p", "prefill", 16, 16 * (s - 1), 0), ("req-d", "decode", 1, 50 + s, 0)]
        skipped = [(r, [f"req-{r}"], {}) for r in SKIP_REASONS]
        events.append(StepPlanned(s, 0.0, "fifo", taken, skipped, [], 256, 17))
    tl._update(Frame(wall=time.time(), events=events))
    return tl


def canvas_px(pg, x, y):
    return pg.evaluate("""([x, y]) => Array.from(document.querySelector('.cbnb-tl-canvas').getContext('2d')
        .getImageData(Math.floor(x), Math.floor(y), 1, 1).data)""", [x, y])


def test_timeline_prefill_cells_look_like_their_swatch_and_columns_keep_width_at_2x(page, tiny_engine):
    tl = timeline_panel(tiny_engine)
    page.set_viewport_size({"width": 1440, "height": 900})
    mount(page, tl)
    page.evaluate("() => { document.getElementById('root').style.width = '1300px'; }")
    try:
        wait_js(page, "() => !!document.querySelector('.cbnb-timeline').__cbnbGeo")
        py_set(page, "view_steps", 50)
        geo1 = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbGeo")
        row = geo1["rows"].index("req-p") - geo1["row0"]
        y = geo1["headH"] + row * geo1["rowH"] - geo1["yOff"] + geo1["rowH"] / 2
        sw = page.evaluate(RGB_JS, page.locator(".cbnb-tl-legend .cbnb-legend-item[data-kind=prefill] .cbnb-swatch")
                           .evaluate("e => getComputedStyle(e).backgroundColor"))
        col = 10 - geo1["first"] - geo1["col0"]
        x0 = geo1["gutter"] + col * geo1["colW"]
        # A 16-token chunk of a 256-token budget: its whole cell (left, middle, right) in the swatch's colour.
        for fx in (0.1, 0.5, 0.8):
            px = canvas_px(page, x0 + fx * (geo1["colW"] - 1), y)
            assert all(abs(a - b) <= 2 for a, b in zip(px, sw)), (fx, px, sw)
        set_scale(page, 2)
        wait_js(page, "() => document.querySelector('.cbnb-timeline').__cbnbGeo.rowH === 28", timeout_ms=10_000)
        geo2 = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbGeo")
        assert geo2["gutter"] <= 240 and geo2["colW"] >= 0.9 * geo1["colW"], (geo1["colW"], geo2["colW"],
                                                                                geo2["gutter"])
        assert geo2["shown"] == geo1["shown"] == 40
        page.screenshot(path=str(ARTIFACTS / "harness-timeline-2x.png"))
    finally:
        set_scale(page, 1)
        page.set_viewport_size({"width": 1000, "height": 1600})


def test_timeline_states_have_distinct_colours_in_both_themes(page, tiny_engine):
    from cbnb.ui.series import SKIP_REASONS

    tl = timeline_panel(tiny_engine)
    from cbnb.telemetry.events import Offload, RequestDone, Restore, StepPlanned
    from cbnb.ui.poller import Frame

    # One request for every other state: swapped out / in swap, soft reset, finished, failed, cancelled.
    more = [StepPlanned(41, 0.0, "fifo", [("req-p", "prefill", 16, 640, 0)], [], [], 256, 16),
            Offload(41, 0.0, "req-d", "swap", "x", 1, 0), Offload(41, 0.0, "req-token_budget", "soft_reset", "x", 1, 4),
            RequestDone(41, 0.0, "req-cache_budget", "FINISHED"), RequestDone(41, 0.0, "req-request_cap", "FAILED"),
            RequestDone(41, 0.0, "req-safety_margin", "CANCELLED"), Restore(42, 0.0, "req-d", 1)]
    tl._update(Frame(wall=time.time(), events=more))
    mount(page, tl)
    wait_js(page, "() => !!document.querySelector('.cbnb-tl-legend [data-kind=prefill] .cbnb-swatch')")
    worst = {}
    swatch = ("() => getComputedStyle(document.querySelector('.cbnb-tl-legend [data-kind=prefill] .cbnb-swatch'))"
              ".backgroundColor")
    try:
        light_prefill = None
        for dark in (False, True):
            set_theme(page, dark)
            if dark:  # the panel redraws 150 ms after the theme changes: wait for the new colours
                wait_js(page, f"(b) => ({swatch})() !== b", arg=light_prefill)
            else:
                light_prefill = page.evaluate(swatch)
            items = page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-tl-legend .cbnb-legend-item'))
                .map(e => [e.dataset.kind || 'waiting:' + e.dataset.reason,
                           getComputedStyle(e.querySelector('.cbnb-swatch')).backgroundColor])""")
            colours = {k: page.evaluate(RGB_JS, c) for k, c in items}
            assert len(colours) == 8 + len(SKIP_REASONS), sorted(colours)  # every state and every waiting reason
            pairs = sorted((lab_de(a, b), ka, kb) for (ka, a), (kb, b) in itertools.combinations(colours.items(), 2))
            worst["dark" if dark else "light"] = [round(pairs[0][0], 1), pairs[0][1], pairs[0][2]]
            assert pairs[0][0] >= 15, ("dark" if dark else "light", pairs[:3])
            assert lab_de(colours["soft_reset"], colours["failed"]) >= 25
            page.screenshot(path=str(ARTIFACTS / f"harness-timeline-colours-{'dark' if dark else 'light'}.png"))
    finally:
        set_theme(page, False)
    (ARTIFACTS / "timeline_colour_distance.json").write_text(json.dumps(worst))


# ---------------------------------------------------------------------------------------------- plots
def plots_panel(tiny_engine, n=60, runs=()):
    from cbnb.ui.plots import LivePlotsPanel

    plots = LivePlotsPanel(tiny_engine, autostart=False)
    for i in range(n):
        plots._step_series.append({"step": i + 1, "prefill": 40 + (i % 5) * 10, "decode": 4, "budget": 64,
                                   "requests": 3, "skip_token_budget": 1 + i % 2})
    plots.steps = plots._step_series.arrays()
    plots.runs = list(plots.runs) + list(runs)
    return plots


def test_plots_newest_bar_is_whole_and_run_labels_stay_inside(page, tiny_engine):
    from cbnb.ui.plots import plotly_lib

    label = "max_batch_tokens=256, num_blocks=128, page_size=32, safety_margin=0.1"
    plots = plots_panel(tiny_engine, runs=[{"index": 1, "step": 52, "cause": "reconfigure", "label": label,
                                            "t": 0.0}])
    lib = plotly_lib()
    page.set_viewport_size({"width": 1440, "height": 900})
    mount(page, plots, models={lib.model_id: widget_state(lib)})
    page.evaluate("() => { document.getElementById('root').style.width = '1300px'; }")
    try:
        wait_js(page, "() => (document.querySelector('.cbnb-plot-grid') || {}).__cbnbDraws >= 6", timeout_ms=60_000)
        geo = page.evaluate("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot')[0];
            const xa = g._fullLayout.xaxis, sz = g._fullLayout._size;
            const fill = g.querySelector('.scatterlayer .trace .js-fill').getBoundingClientRect();
            const plot = g.querySelector('.nsewdrag').getBoundingClientRect();
            return {range: xa.range, xmax: Math.max(...g.data[0].x), col: xa.l2p(1) - xa.l2p(0),
                    fillRight: fill.right, plotRight: plot.right, newest: xa.l2p(60.499) - xa.l2p(59.5)}; }""")
        assert geo["xmax"] <= geo["range"][1] and geo["range"][1] - geo["xmax"] < 0.01, geo
        assert geo["newest"] >= 0.95 * geo["col"], geo  # the newest step is a whole column wide
        assert abs(geo["fillRight"] - geo["plotRight"]) <= 2, geo  # drawn up to the right edge, not cut before it
        for i in range(6):
            info = page.evaluate("""(i) => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot')[i];
                const plot = g.querySelector('.nsewdrag').getBoundingClientRect();
                const ann = Array.from(g.querySelectorAll('.annotation')).filter(a => /run 1/.test(a.textContent));
                const ticks = Array.from(g.querySelectorAll('.xtick text, .ytick text, .y2tick text'))
                  .map(t => t.getBoundingClientRect()).filter(b => b.width > 0);
                return {plot: {x: plot.x, y: plot.y, width: plot.width, height: plot.height},
                        anns: ann.map(a => { const b = a.querySelector('.annotation-text-g').getBoundingClientRect();
                          return {text: a.textContent, x: b.x, y: b.y, width: b.width, height: b.height}; }),
                        ticks: ticks.map(b => ({x: b.x, y: b.y, width: b.width, height: b.height}))}; }""", i)
            assert len(info["anns"]) == 1, (i, info["anns"])
            a, p = info["anns"][0], info["plot"]
            assert a["text"].replace(" ", "") == f"run 1: {label}".replace(" ", ""), a["text"]  # whole, no "…"
            assert p["x"] - 0.5 <= a["x"] and a["x"] + a["width"] <= p["x"] + p["width"] + 0.5, (i, a, p)
            assert not [t for t in info["ticks"] if _overlaps(a, t)], (i, a)
        page.screenshot(path=str(ARTIFACTS / "harness-plots-newest-bar-run-label.png"), full_page=True)
    finally:
        page.set_viewport_size({"width": 1000, "height": 1600})


def test_notebook_chart_template_on_a_dark_page(page):
    """The plotly template of notebooks 03/04 (cbnb.ui.plot_theme) drawn by plotly.js on a dark page: no white paper
    or plot area, and text that reads on the dark background and on a light one."""
    pio = pytest.importorskip("plotly.io")
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from cbnb.ui.plot_theme import use_theme_template
    from cbnb.ui.plots import _plotly_js

    saved = pio.templates.default
    try:
        pio.templates.default = "plotly"
        use_theme_template()
        fig = make_subplots(rows=1, cols=3, subplot_titles=("offloads", "tokens recomputed", "output tokens/s"))
        fig.add_trace(go.Bar(x=["swap", "soft reset"], y=[3, 5], name="swaps"), 1, 1)
        fig.add_trace(go.Bar(x=["swap", "soft reset"], y=[0, 120], name="recomputed"), 1, 2)
        fig.add_trace(go.Bar(x=["swap", "soft reset"], y=[21, 17], name="tok/s"), 1, 3)
        fig.update_layout(height=340, barmode="group")
        spec = json.loads(fig.to_json())
    finally:
        pio.templates.default = saved
    page.set_viewport_size({"width": 1440, "height": 900})
    page.set_content("<!doctype html><html><body style='background:#111111;margin:0'><div id=g style='width:1200px'>"
                     "</div></body></html>")
    page.add_script_tag(content=_plotly_js()[0].decode("utf-8"))
    page.evaluate("(f) => Plotly.newPlot('g', f.data, f.layout)", spec)
    try:
        got = page.evaluate("""() => { const g = document.getElementById('g');
            const svg = g.querySelector('.main-svg'), bg = g.querySelector('.bglayer rect.bg');
            const tick = g.querySelector('.xtick text'), title = g.querySelector('.annotation-text');
            return {paper: g._fullLayout.paper_bgcolor, plot: g._fullLayout.plot_bgcolor,
                    svgBg: getComputedStyle(svg).backgroundColor,
                    plotOpacity: bg ? getComputedStyle(bg).fillOpacity : '0',
                    tick: getComputedStyle(tick).fill, title: getComputedStyle(title).fill}; }""")
        assert got["paper"] == "rgba(0, 0, 0, 0)" and got["plot"] == "rgba(0, 0, 0, 0)", got
        assert got["svgBg"] == "rgba(0, 0, 0, 0)", got
        assert float(got["plotOpacity"]) == 0, got  # the plot area is not painted
        for k in ("tick", "title"):
            rgb = page.evaluate(RGB_JS, got[k])
            assert contrast(rgb, (17, 17, 17)) >= 4 and contrast(rgb, (255, 255, 255)) >= 4, (k, rgb)
        page.screenshot(path=str(ARTIFACTS / "harness-notebook-chart-dark.png"))
    finally:
        page.set_viewport_size({"width": 1000, "height": 1600})


# ---------------------------------------------------------------------------------------------- submit, controls, board
def test_double_click_on_submit_sends_one_submission(page, tiny_engine):
    from cbnb.ui.submit import SubmitPanel

    mount(page, SubmitPanel(tiny_engine, autostart=False))
    page.locator(".cbnb-prompt").fill("Once only")
    btn = page.locator(".cbnb-submit-btn")
    btn.dblclick()
    subs = [m for m in sent(page) if m.get("kind") == "submit"]
    assert len(subs) == 1 and subs[0]["prompt"] == "Once only" and subs[0]["nonce"]
    assert btn.is_disabled() and btn.text_content() == "Submitting…"
    page.locator(".cbnb-prompt").press("Control+Enter")  # still in flight: no second one
    assert len([m for m in sent(page) if m.get("kind") == "submit"]) == 1
    page.evaluate("(m) => window.__h.pySend(m)", {"kind": "submitted", "nonce": "someone else's"})
    assert btn.is_disabled()
    page.evaluate("(m) => window.__h.pySend(m)", {"kind": "submitted", "nonce": subs[0]["nonce"]})
    page.wait_for_function("() => !document.querySelector('.cbnb-submit-btn').disabled", timeout=5_000)
    btn.click()  # a new gesture: a new submission with a new id
    subs = [m for m in sent(page) if m.get("kind") == "submit"]
    assert len(subs) == 2 and subs[1]["nonce"] != subs[0]["nonce"]


def test_step_rate_words_and_board_paused(page, tiny_engine):
    from cbnb.ui.board import RequestBoardPanel
    from cbnb.ui.controls import ControlsPanel

    ctl = ControlsPanel(tiny_engine, autostart=False)
    mount(page, ctl, state=dict(widget_state(ctl), step_rate=1.0, last_step=7))
    status = page.locator(".cbnb-controls-status").text_content()
    assert "slow motion (1 step/s) · step 7" in status, status
    options = page.locator(".cbnb-rate option").all_text_contents()
    assert options == ["off", "0.5 steps/s", "1 step/s", "2 steps/s", "5 steps/s", "10 steps/s"], options
    board = RequestBoardPanel(tiny_engine, autostart=False)
    mount(page, board, state=dict(widget_state(board), engine_state="paused"))
    assert "engine paused (step mode: Step or Resume)" in page.locator(".cbnb-board").text_content()
    assert "engine running" not in page.locator(".cbnb-board").text_content()


# ---------------------------------------------------------------------------------------------- issue 40, item 5
def test_why_colours_an_end_as_the_timeline_does(page, tiny_engine):
    """Why?'s swatch of a CANCELLED end was FINISHED's green; the timeline draws cancelled grey, failed red."""
    from cbnb.ui.why import WhyPanel

    why = WhyPanel(tiny_engine, autostart=False)
    seen = {}
    try:
        for dark in (False, True):
            for state in ("FINISHED", "FAILED", "CANCELLED"):
                why.request_id = "req-9"
                story = {"request_id": "req-9", "state": state, "headline": "req-9",
                         "entries": [{"kind": "end", "step": 3, "last_step": 3, "span": "step 3",
                                      "text": f"{state}: 2 tokens", "fields": []}]}
                why.story = {}
                mount(page, why)
                set_theme(page, dark)  # (mount replaces the page's body)
                py_set(page, "story", story)
                wait_js(page, "() => !!document.querySelector('.cbnb-why-entry[data-kind=end] .cbnb-swatch')")
                css = page.evaluate("() => getComputedStyle(document.querySelector("
                                    "'.cbnb-why-entry[data-kind=end] .cbnb-swatch')).backgroundColor")
                seen[(dark, state)] = tuple(page.evaluate(RGB_JS, css))
    finally:
        set_theme(page, False)
    # the timeline's end colours (widgets/timeline.js)
    assert seen[(False, "CANCELLED")] == (138, 138, 138) and seen[(True, "CANCELLED")] == (154, 154, 154)
    assert seen[(False, "FINISHED")] == (63, 158, 58) and seen[(False, "FAILED")] == (214, 39, 40)
    for dark in (False, True):
        assert lab_de(seen[(dark, "CANCELLED")], seen[(dark, "FINISHED")]) >= 25


# ---------------------------------------------------------------------------------------------- issue 40, item 7
@pytest.mark.parametrize("width,scale", [(1050, 1.0), (1300, 2.0)])
def test_board_fits_beside_the_file_browser_and_at_2x(page, tiny_engine, width, scale):
    """The board needed horizontal scrolling at 2x on a 1440-wide screen (notebook ~1300 px) and at 1x with
    JupyterLab's file browser open (~1000 px): its columns now fit, "source" included."""
    from cbnb.core.requests import RequestOutput, RequestState
    from cbnb.ui.board import RequestBoardPanel
    from cbnb.ui.state import request_rows

    long = "Explain, step by step and with an example, what a paged KV cache is and why it helps batching"
    outs = [RequestOutput(f"http-{i}", [1] * 40, [5] * 3, state=RequestState.DECODING, max_new_tokens=64,
                          prompt_text=long, source="http 127.0.0.1:53211",
                          processors=("repetition_penalty=1.2", "temperature=0.7")) for i in range(3)]
    outs.append(RequestOutput("req-c", [1] * 9, [], state=RequestState.FAILED, error="boom: " + long,
                              finish_reason="error"))
    board = RequestBoardPanel(tiny_engine, autostart=False)
    board.rows, board.counts, board.hidden = request_rows(outs)
    page.set_viewport_size({"width": width, "height": 900})
    try:
        mount(page, board)
        page.evaluate("(w) => { document.getElementById('root').style.width = w + 'px'; }", width - 30)
        set_scale(page, scale)
        page.wait_for_selector(".cbnb-board tr[data-id=http-0]")
        for dark in (False, True):
            set_theme(page, dark)
            page.wait_for_timeout(100)
            fit = page.evaluate("""() => { const w = document.querySelector('.cbnb-table-wrap');
                const src = document.querySelector('.cbnb-board th.cbnb-col-source').getBoundingClientRect();
                return [w.scrollWidth, w.clientWidth, src.right, w.getBoundingClientRect().right]; }""")
            assert fit[0] <= fit[1] + 1 and fit[2] <= fit[3] + 1, fit  # no sideways scroll; "source" inside
            page.screenshot(path=str(ARTIFACTS / f"harness-board-{width}px-{scale:g}x-{'dark' if dark else 'light'}"
                                                 ".png"))
    finally:
        set_theme(page, False)
        set_scale(page, 1.0)
        page.set_viewport_size({"width": 1000, "height": 1600})


def test_config_code_wraps_instead_of_scrolling_sideways(page, tiny_engine):
    panel = config_panel(tiny_engine)
    page.set_viewport_size({"width": 700, "height": 900})
    try:
        mount(page, panel)
        set_scale(page, 2.0)
        page.wait_for_selector(".cbnb-config pre.cbnb-code")
        page.wait_for_timeout(200)
        box = page.evaluate("""() => { const p = document.querySelector('.cbnb-config pre.cbnb-code');
            return [p.scrollWidth, p.clientWidth, p.textContent.length]; }""")
        assert box[2] > 40 and box[0] <= box[1] + 1, box
    finally:
        set_scale(page, 1.0)
        page.set_viewport_size({"width": 1000, "height": 1600})


def test_free_kv_blocks_read_on_the_dark_background(page):
    """Free blocks were dark grey (62, 66, 72) on JupyterLab's near-black: now a contrast of 2.5:1 at least."""
    from cbnb.ui.kvmap import KVPageMapPanel
    from helpers_ui import synthetic_snapshot

    class _E:
        from cbnb.telemetry.events import EventLog

        events = EventLog(10)

    kv = KVPageMapPanel(_E(), autostart=False)
    from cbnb.ui.state import encode_kv

    kv.groups, kv.cells = encode_kv(synthetic_snapshot(256, 4))
    mount(page, kv)
    set_theme(page, True)
    try:
        page.wait_for_selector(".cbnb-kv-canvas")
        py_set(page, "request_count", 4)
        free = page.evaluate("""() => { const items = Array.from(document.querySelectorAll('.cbnb-legend-item'));
            const it = items.find((e) => /free/.test(e.textContent));
            return it ? getComputedStyle(it.querySelector('.cbnb-swatch')).backgroundColor : null; }""")
        assert free, "the page map's legend names free blocks"
        assert contrast(page.evaluate(RGB_JS, free), (17, 17, 17)) >= 2.5, free
    finally:
        set_theme(page, False)


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_plots_right_axis_titles_are_whole_at_2x(page, tiny_engine, scale):
    """The right-axis title of "Tokens per step" ("decode tokens") was seen clipped to "ens" on a projector in
    JupyterLab; in the harness it is whole at 1x and 2x (a guard: the JupyterLab case was not reproduced here)."""
    from cbnb.ui.plots import plotly_lib

    plots = plots_panel(tiny_engine)
    lib = plotly_lib()
    page.set_viewport_size({"width": 1440, "height": 900})
    mount(page, plots, models={lib.model_id: widget_state(lib)})
    page.evaluate("() => { document.getElementById('root').style.width = '1300px'; }")
    try:
        wait_js(page, "() => (document.querySelector('.cbnb-plot-grid') || {}).__cbnbDraws >= 6", timeout_ms=60_000)
        if scale != 1.0:  # every chart redraws at the new scale
            set_scale(page, scale)
            # (charts off screen redraw when scrolled to: the first one, "Tokens per step", is on screen)
            wait_js(page, "() => { const g = document.querySelector('.cbnb-plots .js-plotly-plot');"
                          f" return g._fullLayout && g._fullLayout.height === {round(250 * (1 + 0.6 * (scale - 1)))}; }}",
                    timeout_ms=60_000)
        boxes = page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).slice(0, 1).map((g) => {
            const t = g.querySelector('.g-y2title text'); if (!t) return null;
            const b = t.getBoundingClientRect(), s = g.getBoundingClientRect();
            return {text: t.textContent, top: b.top, bottom: b.bottom, left: b.left, right: b.right,
                    gtop: s.top, gbottom: s.bottom, gleft: s.left, gright: s.right}; }).filter(Boolean)""")
        assert any(b["text"] == "decode tokens" for b in boxes), boxes
        for b in boxes:
            assert b["gtop"] - 0.5 <= b["top"] and b["bottom"] <= b["gbottom"] + 0.5, b
            assert b["gleft"] - 0.5 <= b["left"] and b["right"] <= b["gright"] + 0.5, b
        page.screenshot(path=str(ARTIFACTS / f"harness-plots-right-axis-{scale:g}x.png"), full_page=True)
    finally:
        set_scale(page, 1.0)
        page.set_viewport_size({"width": 1000, "height": 1600})
