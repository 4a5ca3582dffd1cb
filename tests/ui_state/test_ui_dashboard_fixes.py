"""The dashboard's Python side for the defects of issue 20 (no browser): the "Why?" story quotes the config in force at
each step, the board's cached count stays within the prompt across a reconfigure, step-mode status and a re-made
dashboard start where the engine is, one Submit gesture submits once, and the notebooks' plotly template."""

from __future__ import annotations

import time

import pytest

import cbnb
from cbnb.telemetry.events import RequestAdded, RunStarted, StepPlanned
from cbnb.telemetry.explain import StoryBuilder
from cbnb.ui import ControlsPanel, RequestBoardPanel, SubmitPanel
from cbnb.ui.poller import Frame, Poller
from cbnb.ui.state import request_rows
from cbnb.ui.timeline import TimelinePanel
from cbnb.ui.why import WhyPanel

from helpers_engine import TIMEOUT, tiny_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


def frame(engine, events=(), requests=None) -> Frame:
    return Frame(wall=time.time(), events=list(events), requests=requests, engine_state="running")


# ---------------------------------------------------------------------------------------------- why: config in force
def test_story_quotes_the_config_of_the_step_not_todays():
    old = cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64).resolve("cpu")
    new = old.copy(max_batch_tokens=256)
    from cbnb.engine.phases import config_values

    events = [RequestAdded(0, 0.0, "r", 100, 8),
              StepPlanned(1, 0.1, "fifo", [("q", "prefill", 64, 0, 0)],
                          [("token_budget", ["r"], {"budget_tokens": 64, "left_tokens": 0})], [], 64, 64),
              RunStarted(1, 0.2, "reconfigure", "max_batch_tokens=256", config_values(old), config_values(new)),
              StepPlanned(2, 0.3, "fifo", [("q", "prefill", 256, 0, 0)],
                          [("token_budget", ["r"], {"budget_tokens": 256, "left_tokens": 0})], [], 256, 256)]
    b = StoryBuilder("r", new)
    b.feed(events)
    waits = [e for e in b.story().entries if e.kind == "waiting"]
    assert [e.step for e in waits] == [1, 2]
    assert "budget 64 tokens" in waits[0].text
    assert waits[0].advice.endswith("(at step 1: max_batch_tokens=64; now max_batch_tokens=256)"), waits[0].advice
    assert waits[1].advice.endswith("(now max_batch_tokens=256)"), waits[1].advice
    # Without the marker's values (an older log), the step's own budget still gives the number in force.
    bare = StoryBuilder("r", new)
    bare.feed([e if e.kind != "run_started" else RunStarted(1, 0.2, "reconfigure", "max_batch_tokens=256")
               for e in events])
    first = next(e for e in bare.story().entries if e.kind == "waiting")
    assert "(at step 1: max_batch_tokens=64; now max_batch_tokens=256)" in first.advice, first.advice
    # The Why panel and engine.explain's text say the same.
    assert "max_batch_tokens=64; now max_batch_tokens=256" in b.story().text()


@pytest.fixture(scope="module")
def reconfigured():
    """Two requests with one 100-token prompt under max_batch_tokens=32 (the second waits for the token budget, then
    shares the first's blocks), reconfigured to max_batch_tokens=64 while both decode; then run to the end. In the
    new cache the first recomputes first, so the second matches its blocks again (a second prefix hit)."""
    eng = cbnb.Engine(tiny_model("tiny:llama"), None, cbnb.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=32, allow_block_sharing=True))
    eng.pause()
    eng.start()
    prompt = [5 + (i % 300) for i in range(100)]
    a = eng.submit(prompt, max_new_tokens=24, eos_token_id=-1)
    b = eng.submit(prompt, max_new_tokens=24, eos_token_id=-1)
    for _ in range(40):
        eng.step(timeout=TIMEOUT)
        st = {o.request_id: o.state.name for o in eng.requests_snapshot()}
        if st.get(a.request_id) == st.get(b.request_id) == "DECODING":
            break
    before = {o.request_id: o.prefix_cached_tokens for o in eng.requests_snapshot()}
    eng.reconfigure(eng.user_config.copy(max_batch_tokens=64), timeout=TIMEOUT)
    eng.resume()
    outs = [a.result(TIMEOUT), b.result(TIMEOUT)]
    yield eng, a, b, outs, before
    eng.stop()


def test_why_after_a_reconfigure_quotes_the_budget_of_that_step(reconfigured):
    eng, _a, b, _outs, _before = reconfigured
    story = eng.explain(b.request_id)
    wait = next(e for e in story.entries if e.kind == "waiting" and e.reason == "token_budget")
    assert "budget 32 tokens" in wait.text
    assert "max_batch_tokens=32; now max_batch_tokens=64" in wait.advice, wait.advice
    assert "(now max_batch_tokens=64)" not in wait.advice
    assert any(e.kind == "reconfigure" for e in story.entries)
    panel = WhyPanel(eng, autostart=False)
    panel.explain(b.request_id)
    shown = next(e for e in panel.story["entries"] if e["kind"] == "waiting" and e["reason"] == "token_budget")
    assert shown["advice"] == wait.advice  # the panel quotes what engine.explain quotes
    assert "max_batch_tokens=32; now max_batch_tokens=64" in panel.text


def test_board_cached_count_never_exceeds_the_prompt_across_a_reconfigure(reconfigured):
    eng, a, b, outs, before = reconfigured
    assert before[b.request_id] > 0  # b shared a's prompt blocks at its first admission
    for o in outs:
        assert 0 <= o.prefix_cached_tokens <= len(o.prompt_token_ids), (o.request_id, o.prefix_cached_tokens)
    rows, _counts, _hidden = request_rows(eng.requests_snapshot())
    board = RequestBoardPanel(eng, autostart=False)
    col = board.columns.index("prefix_cached_tokens")
    prompt_col = board.columns.index("prompt_tokens") if "prompt_tokens" in board.columns else None
    for r in rows:
        if r[0] in (a.request_id, b.request_id):
            assert r[col] <= 100, r
            if prompt_col is not None:
                assert r[col] <= r[prompt_col]
    # b was served from the cache at both admissions (the sum of its hits is more than its prompt): each counts alone.
    hits = [e.tokens for e in eng.events.events("prefix_hit") if e.request_id == b.request_id]
    assert len(hits) >= 2 and sum(hits) > 100, hits
    assert outs[1].prefix_cached_tokens == min(hits[-1], 100)


# ---------------------------------------------------------------------------------------------- step mode status
@pytest.fixture
def ran_engine():
    """An engine that ran 1 request to the end (several steps), then paused."""
    eng = cbnb.Engine(tiny_model("tiny:llama"), None, cbnb.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=16))
    eng.start()
    eng.submit(list(range(5, 45)), max_new_tokens=4, eos_token_id=-1).result(TIMEOUT)
    yield eng
    eng.stop()


def test_a_dashboard_made_after_steps_shows_the_current_step_and_summary(ran_engine):
    eng = ran_engine
    steps = eng.events.events("step_planned")
    last = steps[-1].step
    assert last >= 5
    ctl = ControlsPanel(eng, autostart=False)
    assert ctl.last_step == last
    assert ctl.message.startswith(f"Step {last}: ") and "decode" in ctl.message, ctl.message
    # A shared poller made before the panel (as Dashboard does) reads the same events again: counted once.
    poller = Poller(eng)
    tl = TimelinePanel(eng, poller=poller)
    seeded = (tl.timeline.last_step, tl.timeline.version, bytes(tl.timeline.cells.tobytes()))
    assert tl.timeline.last_step == last
    poller.tick(force=True)
    assert tl.num_steps == len(steps) and tl.first_step == steps[0].step
    assert (tl.timeline.last_step, bytes(tl.timeline.cells.tobytes())) == (seeded[0], seeded[2])
    assert any(r["id"] for r in tl.rows)
    poller.stop()


def test_board_says_paused_and_slow_motion_says_each_step(ran_engine):
    eng = ran_engine
    board = RequestBoardPanel(eng, autostart=False)
    assert board._values(frame(eng, requests=[]))["engine_state"] == "running"
    eng.pause()
    assert board._values(frame(eng, requests=[]))["engine_state"] == "paused"
    eng.resume()
    ctl = ControlsPanel(eng, autostart=False)
    ctl.set_step_rate(1.0)
    assert ctl.message == "Slow motion: at most 1 step per second."
    ctl.resume()
    assert ctl.message == "Running in slow motion: at most 1 step per second."
    ev = StepPlanned(41, 0.0, "fifo", [("req-x", "prefill", 16, 0, 0), ("req-y", "decode", 1, 9, 0)],
                     [("token_budget", ["req-z"], {"budget_tokens": 16, "left_tokens": 0})], [], 16, 16)
    ctl._update(frame(eng, [ev], requests=[]))
    assert ctl.message == ("Step 41: req-x prefill 16 tokens, 1 decode; 1 left out (token budget). "
                           "Slow motion: at most 1 step per second."), ctl.message
    ctl.set_step_rate(2.0)
    assert ctl.message == "Slow motion: at most 2 steps per second."
    ctl.set_step_rate(0.0)
    ctl._update(frame(eng, [StepPlanned(42, 0.0, "fifo", [], [], [], 16, 0)], requests=[]))
    assert ctl.message == "Slow motion off."  # full speed: no per-step line


# ---------------------------------------------------------------------------------------------- submit
def test_one_gesture_id_submits_once():
    from test_ui_panels import FakeTokenizer  # tests/ is on sys.path

    eng = cbnb.Engine(tiny_model("tiny:llama"), FakeTokenizer(), cbnb.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=64))
    eng.pause()  # nothing runs: only the submissions count
    eng.start()
    try:
        panel = SubmitPanel(eng, autostart=False)
        sent = []
        panel.send = sent.append  # what goes back to the front-end
        gesture = {"kind": "submit", "nonce": "g-1", "prompt": "Hello there", "max_new_tokens": 3, "temperature": 0}
        for _ in range(2):  # the same gesture delivered twice
            panel._dispatch(panel, dict(gesture), [])
        panel._dispatch(panel, dict(gesture, nonce="g-2"), [])  # a new click: a new submission
        assert sent == [{"kind": "submitted", "nonce": "g-1"}, {"kind": "submitted", "nonce": "g-2"}]
        deadline = time.monotonic() + TIMEOUT
        while len(eng.requests_snapshot()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(eng.requests_snapshot()) == 2, eng.requests_snapshot()
        assert panel.message.startswith("Submitted req-")
    finally:
        eng.stop()


# ---------------------------------------------------------------------------------------------- plotly template
def test_notebook_charts_template_is_transparent_with_grey_text():
    pio = pytest.importorskip("plotly.io")
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from cbnb.ui.plot_theme import FONT_COLOR, use_theme_template

    saved = pio.templates.default
    try:
        pio.templates.default = "plotly"
        assert use_theme_template() and pio.templates.default == "plotly+cbnb"
        fig = make_subplots(rows=1, cols=3, subplot_titles=("a", "b", "c"))
        fig.add_trace(go.Bar(x=["on", "off"], y=[1, 2]), 1, 1)
        t = pio.templates[pio.templates.default].layout
        assert t.paper_bgcolor == "rgba(0, 0, 0, 0)" and t.plot_bgcolor == "rgba(0, 0, 0, 0)"
        assert t.font.color == FONT_COLOR and t.xaxis.tickfont.color == FONT_COLOR
        pio.templates.default = "plotly_dark"  # a user's choice is kept
        assert use_theme_template() is False and pio.templates.default == "plotly_dark"
    finally:
        pio.templates.default = saved
