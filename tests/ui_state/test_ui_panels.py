"""Each panel's Python side against a real engine (tiny random model), with no browser: front-end actions are
simulated by the messages the ES modules send, and the poller is ticked by hand where timing matters."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cbnb
from cbnb.ui import (ConfigPanel, Dashboard, KVPageMapPanel, LivePlotsPanel, RequestBoardPanel, SubmitPanel,
                     TokenStreamPanel, attach_headless_dashboard)
from cbnb.ui.poller import Poller

from helpers_engine import tiny_model

CFG = dict(page_size=16, num_blocks=64, max_batch_tokens=64)


class FakeTokenizer:
    """Text <-> ids within the tiny model's vocabulary, with a chat template."""

    chat_template = "{{ messages }}"
    eos_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [3 + (ord(c) % 500) for c in "<user>" + messages[-1]["content"] + "<assistant>"]

    def __call__(self, text):
        return {"input_ids": [3 + (ord(c) % 500) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture
def engine():
    eng = cbnb.Engine(tiny_model("tiny:llama"), FakeTokenizer(), cbnb.ContinuousBatchingConfig(**CFG))
    eng.start()
    yield eng
    eng.stop()


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def msg(panel, **content):
    """What the ES module's model.send(content) does on the Python side."""
    panel._dispatch(panel, content, [])


def ids(n, start=5):
    return [start + (i % 400) for i in range(n)]


# ---------------------------------------------------------------------------------------------- submit
def test_submit_refuses_bad_input_with_a_message(engine):
    p = SubmitPanel(engine, autostart=False)
    for kwargs, text in [({"prompt": ""}, "prompt is empty"), ({"prompt": "   "}, "prompt is empty"),
                         ({"prompt": "hi", "max_new_tokens": 0}, "at least 1"),
                         ({"prompt": "hi", "temperature": -1}, "temperature must be"),
                         ({"prompt": "hi", "max_new_tokens": None}, "not a number"),
                         ({"prompt": "hi", "max_new_tokens": 2.5}, "whole number")]:
        msg(p, kind="submit", **{"max_new_tokens": 8, "temperature": 0.0, **kwargs})  # the ESM sends all three
        assert p.message_kind == "error" and text in p.message, (kwargs, p.message)
    assert engine.requests_snapshot() == []
    msg(p, kind="no_such_action")
    assert p.message_kind == "error" and "unknown action" in p.message


def test_submit_text_without_tokenizer_is_reported():
    eng = cbnb.Engine(tiny_model("tiny:llama"), None, cbnb.ContinuousBatchingConfig(**CFG))
    p = SubmitPanel(eng, autostart=False)
    try:
        assert p.submit("hello") is None
        assert p.message_kind == "error" and "no tokenizer" in p.message
        assert p.chat_template is False
    finally:  # the panel holds the engine: without this the shared tiny model keeps cbnb's attention
        p.close()
        eng.stop()


def test_submit_applies_chat_template_and_sampling(engine):
    p = SubmitPanel(engine, autostart=False)
    assert p.chat_template is True
    msg(p, kind="submit", prompt="Hello there", max_new_tokens=5, temperature=0)
    assert p.message_kind == "ok" and "chat template applied" in p.message and "greedy" in p.message
    rid = p.last_ids[0]
    assert p.prompt == "Hello there" and p.max_new_tokens == 5
    h = p.submit(temperature=0.7, max_new_tokens=3)
    assert "temperature 0.7" in p.message
    assert h.result(30).state.name == "FINISHED" and len(h.result().token_ids) == 3
    first = next(o for o in engine.requests_snapshot() if o.request_id == rid)
    assert first.prompt_token_ids == FakeTokenizer().apply_chat_template([{"content": "Hello there"}])


def test_run_workload_submits_a_standard_workload(engine):
    p = SubmitPanel(engine, autostart=False)
    assert "cpu-32" in p.workloads and "nanovllm-256" not in p.workloads
    msg(p, kind="workload", name="cpu-32", scale=0.07)
    assert p.message_kind == "ok" and "cpu-32" in p.message, p.message
    assert len(p.last_ids) == 2
    msg(p, kind="workload", name="cpu-32", scale=3)
    assert p.message_kind == "error" and "scale" in p.message
    msg(p, kind="workload", name="nope", scale=0.1)
    assert p.message_kind == "error" and "workload must be one of" in p.message


# ---------------------------------------------------------------------------------------------- stream, board
def test_stream_and_board_follow_requests_and_cancel(engine):
    poller = Poller(engine)
    stream = TokenStreamPanel(engine, poller=poller)
    board = RequestBoardPanel(engine, poller=poller)
    done = engine.submit(ids(20), max_new_tokens=4)
    done.result(30)
    long = engine.submit(ids(20, 50), max_new_tokens=400, ignore_eos=True)
    wait_for(lambda: any(o.request_id == long.request_id and len(o.token_ids) >= 2
                         for o in engine.requests_snapshot()))
    poller.tick(force=True)
    item = next(i for i in stream.items if i["id"] == long.request_id)
    assert item["state"] == "DECODING" and item["max"] == 400 and item["text"]
    assert stream.items[0]["id"] == long.request_id  # live first
    msg(stream, kind="cancel", id=long.request_id)
    assert stream.message_kind == "ok"
    assert long.result(30).state.name == "CANCELLED"
    poller.tick(force=True)
    item = next(i for i in stream.items if i["id"] == long.request_id)
    assert item["state"] == "CANCELLED"
    rows = {r[0]: r for r in board.rows}
    assert rows[long.request_id][1] == "CANCELLED" and rows[done.request_id][1] == "FINISHED"
    assert rows[done.request_id][2:4] == [4, 4] and rows[done.request_id][5] is not None  # progress, TTFT ms
    assert board.counts["FINISHED"] == 1 and board.counts["CANCELLED"] == 1 and board.engine_state == "running"
    msg(stream, kind="cancel", id=long.request_id)
    assert stream.message_kind == "info" and "already ended" in stream.message


def test_updates_only_when_something_changed(engine):
    poller = Poller(engine, idle_refresh_s=60)
    board = RequestBoardPanel(engine, poller=poller)
    stamps = []
    board.observe(lambda ch: stamps.append(ch["new"]), names="_stamp")
    engine.submit(ids(10), max_new_tokens=3).result(30)
    time.sleep(0.05)
    assert poller.tick() is not None and len(stamps) == 1
    assert poller.tick() is None  # no new events: nothing read, nothing sent
    assert poller.tick(force=True) is not None and len(stamps) == 1  # read again, but nothing changed


def test_a_failing_panel_does_not_stop_the_others(engine):
    poller = Poller(engine)
    board = RequestBoardPanel(engine, poller=poller)
    broken = TokenStreamPanel(engine, poller=poller)
    broken._values = lambda frame: 1 / 0
    engine.submit(ids(10), max_new_tokens=2).result(30)
    poller.tick(force=True)
    assert board.rows and "ZeroDivisionError" in broken.message and broken.message_kind == "error"
    assert poller.errors and "ZeroDivisionError" in poller.errors[-1]


# ---------------------------------------------------------------------------------------------- KV map
def test_kvmap_is_pushed_whether_or_not_a_view_reported_itself_on_screen(engine):
    # The visibility report is a browser message, which may wait behind a busy cell: data never waits on it.
    poller = Poller(engine)
    kv = KVPageMapPanel(engine, poller=poller)
    h = engine.submit(ids(40), max_new_tokens=200, ignore_eos=True)
    wait_for(lambda: any(o.state.name == "DECODING" for o in engine.requests_snapshot()))
    for _ in range(2):
        poller.tick(force=True)
        assert kv._needs() == {"snapshot"} and not any(kv._views.values())
    assert kv.groups[0]["counts"]["allocated"] >= 3
    h.cancel()


def test_kvmap_snapshots_only_when_visible_when_asked_and_answers_hover(engine):
    poller = Poller(engine)
    kv = KVPageMapPanel(engine, poller=poller, always_snapshot=False)
    assert kv._needs() == {"snapshot"}  # one first snapshot, so a new view has something to show
    h = engine.submit(ids(40), max_new_tokens=200, ignore_eos=True)
    wait_for(lambda: any(o.state.name == "DECODING" for o in engine.requests_snapshot()))
    poller.tick(force=True)
    assert kv._needs() == set() and not kv.visible
    msg(kv, kind="visible", view="v1", on=True)
    assert kv.visible and kv._needs() == {"snapshot"}
    poller.tick(force=True)
    cells = np.frombuffer(kv.cells, dtype=np.uint8)
    g = kv.groups[0]
    assert len(cells) == g["num_blocks"] == 66 and g["counts"]["reserved"] == 2 and g["counts"]["allocated"] >= 3
    block = int(np.flatnonzero((cells & 7) == 1)[0])
    replies = []
    kv.send = lambda content, buffers=None: replies.append(content)
    msg(kv, kind="hover", group=0, block=block, seq=7)
    assert replies[-1]["seq"] == 7 and replies[-1]["owners"] == [h.request_id] and replies[-1]["tokens"] > 0
    msg(kv, kind="hover", group=0, block=10_000, seq=8)
    assert "block must be in" in replies[-1]["error"]
    msg(kv, kind="visible", view="v1", on=False)
    assert not kv.visible
    h.cancel()


# ---------------------------------------------------------------------------------------------- plots
def test_plots_hold_current_series_in_synced_state(engine):
    poller = Poller(engine)
    plots = LivePlotsPanel(engine, poller=poller)
    for k in range(3):
        engine.submit(ids(30 + k), max_new_tokens=6).result(30)
        poller.tick(force=True)
    arr = plots.series_arrays()
    steps = arr["steps"]["step"]
    assert len(steps) >= 6 and np.all(np.diff(steps) > 0)
    assert (arr["steps"]["budget"] == 64).all() and arr["steps"]["decode"].sum() == 3 * 5
    assert plots.summary["graph_captures"] == 0 and plots.summary["device"] == "cpu"
    assert plots.summary["graphs_enabled"] is False
    # A front-end that connects now (e.g. after a page reload) receives exactly the current series.
    state = plots.get_state()
    assert state["steps"]["step"] == plots.steps["step"] and state["series"] == plots.series
    assert plots._lib and plots._lib != plots.model_id
    msg(plots, kind="new_run")
    assert engine.stats()["run"]["steps"] == 0
    # A new run is a new segment at this step (earlier ones stay, faded): its marker, and the rows after it.
    last = int(steps[-1])
    engine.submit(ids(33), max_new_tokens=3).result(30)
    poller.tick(force=True)
    assert [(r["index"], r["cause"]) for r in plots.runs] == [(0, "start"), (1, "reset_stats")]
    assert plots.runs[1]["step"] == last and plots.runs[1]["label"] == "New run button"
    arr = plots.series_arrays()
    run = arr["steps"]["run"][arr["steps"]["step"] > last]
    assert len(run) == 3 and (run == 1).all() and (arr["steps"]["run"][arr["steps"]["step"] <= last] == 0).all()
    series = arr["series"]
    assert np.isnan(series["step"]).any()  # the lines break where the segment starts
    assert plots.summary["run_index"] == 1


@pytest.mark.slow
def test_figurewidget_would_restore_stale_data():
    """Why the plots are not FigureWidgets: its synced state keeps display-time data (plotly 7.1)."""
    import plotly.graph_objects as go

    fig = go.FigureWidget(data=[go.Scatter(y=[1, 2, 3])])
    fig._repr_mimebundle_()  # displayed
    fig.data[0].y = [5, 1, 4]
    assert fig.get_state()["_widget_data"][0]["y"] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- config
def test_config_preview_code_and_validation(engine):
    p = ConfigPanel(engine, autostart=False)
    assert p.values["page_size"] == 16 and p.values["sizing"] == "num_blocks" and p.values["num_blocks"] == 64
    assert {f["name"] for f in p.fields} >= {"page_size", "num_blocks", "max_memory_percent", "max_batch_tokens",
                                             "max_requests_per_batch", "scheduler_type", "safety_margin",
                                             "allow_block_sharing", "cpu_offload_space", "q_padding_interval_size",
                                             "kv_padding_interval_size", "use_cuda_graph", "use_async_batching"}
    assert all(f["help"] for f in p.fields)
    before = dict(p.memory["proposed"])
    p.set(max_batch_tokens=256, num_blocks=128)
    assert p.memory["proposed"]["activations"] > before["activations"]
    assert p.memory["proposed"]["kv_cache"] > before["kv_cache"] and p.memory["num_blocks"] == 128
    assert p.memory["current"] == engine.memory_split()  # nothing allocated by the preview
    assert "ContinuousBatchingConfig(" in p.code and "max_batch_tokens=256" in p.code and "num_blocks=128" in p.code
    assert "max_requests_per_batch" not in p.code  # untouched None fields keep resolving on their own
    p.set(page_size=2)
    assert "page_size" in p.memory["error"]
    assert p.apply() is False and p.message_kind == "error" and "page_size" in p.message
    assert engine.config.page_size == 16
    msg(p, kind="reset")
    assert p.values["page_size"] == 16 and p.memory["error"] == ""
    p.set(sizing="max_memory_percent", max_memory_percent=0.05)
    assert p.memory["error"] == "" and p.memory["num_blocks"] > 64 and "num_blocks" not in p.code
    # every scheduler the config accepts is offered; vLLM's has no transformers spelling, and the code says so
    assert next(f for f in p.fields if f["name"] == "scheduler_type")["options"] == ["fifo", "prefill_first", "vllm"]
    p.set(scheduler_type="vllm")
    assert p.memory["error"] == "" and "no transformers equivalent" in p.code and "'vllm'" not in p.code.split("\n")[-2]


def test_config_apply_retunes_between_runs_and_keeps_queued_requests(engine):
    poller = Poller(engine)
    p = ConfigPanel(engine, poller=poller)
    handles = [engine.submit(ids(30, k), max_new_tokens=30, ignore_eos=True) for k in range(4)]
    msg(p, kind="apply", values={"max_batch_tokens": 128, "page_size": 32, "num_blocks": 48})
    assert p.busy or p.applied_count == 1  # the apply may already be done when the loop thread is quick
    wait_for(lambda: p.applied_count == 1 and not p.busy, timeout=60)
    assert p.message_kind == "ok", p.message
    assert engine.config.max_batch_tokens == 128 and engine.config.page_size == 32 and engine.config.num_blocks == 48
    assert [h.result(60).state.name for h in handles] == ["FINISHED"] * 4  # nothing queued is lost
    assert all(len(h.result().token_ids) == 30 for h in handles)
    assert p.applied["max_batch_tokens"] == 128 and p.values == p.applied
    # A config changed from code is picked up by the panel.
    engine.reconfigure(engine.config.copy(max_batch_tokens=96))
    poller.tick(force=True)
    assert p.values["max_batch_tokens"] == 96


# ---------------------------------------------------------------------------------------------- dashboard
def test_dashboard_one_poller_rate_limited_and_closed(engine):
    d = Dashboard(engine, max_hz=5)
    try:
        assert len({id(p.poller) for p in d.panels}) == 1 and d.poller.running
        names = [t.name for t in threading.enumerate()]
        assert names.count("cbnb-ui-poller") == 1
        t0 = time.monotonic()
        t_ticks = d.poller.ticks
        engine.generate([ids(20, k) for k in range(3)], max_new_tokens=40, ignore_eos=True, timeout=60)
        dt = time.monotonic() - t0
        assert d.poller.ticks - t_ticks <= 5 * dt + 2  # <= max_hz
        assert d.poller.errors == []
        time.sleep(0.3)
        assert any(r[1] == "FINISHED" for r in d.board.rows)
    finally:
        d.close()
    assert "cbnb-ui-poller" not in [t.name for t in threading.enumerate()]


def test_headless_dashboard_runs_the_live_machinery(engine):
    h = attach_headless_dashboard(engine)
    try:
        engine.generate([ids(20, k) for k in range(3)], max_new_tokens=20, ignore_eos=True, timeout=60)
        time.sleep(0.3)
        st = h.stats()
        assert st["ticks"] >= 2 and st["errors"] == [] and st["messages"] >= st["ticks"]
        assert st["json_bytes"] > 0 and st["buffer_bytes"] > 0  # board/stream JSON, plot and page-map bytes
        d = h.dashboard
        assert d.kvmap.cells and d.plots.steps["step"] and d.stream.items and d.board.rows
    finally:
        h.close()
    assert not h.poller.running


def test_assets_are_esm_modules_with_shared_helpers():
    from cbnb.ui import _assets

    for name in ("submit.js", "stream.js", "board.js", "kvmap.js", "plots.js", "config.js", "server.js"):
        src = _assets.esm(name)
        assert "export default" in src and "function cbnbFrame" in src
    assert ".cbnb-panel" in _assets.css()
    assert _assets.asset_origin() in ("package", "checkout")
    with pytest.raises(FileNotFoundError):
        _assets.read_asset("missing.js")


@pytest.mark.parametrize("headless", [False, True])
def test_closing_the_dashboard_releases_the_engine(headless):
    import gc
    import weakref

    import ipywidgets.widgets.widget as W

    eng = cbnb.Engine(tiny_model("tiny:llama"), FakeTokenizer(), cbnb.ContinuousBatchingConfig(**CFG))
    ref = weakref.ref(eng)
    before = set(W._instances)
    d = attach_headless_dashboard(eng) if headless else Dashboard(eng)
    with eng:
        eng.generate([ids(8)], max_new_tokens=2)
    d.close()
    del d, eng
    gc.collect()
    assert ref() is None  # the benchmark builds one engine per variant: a leak would skew its memory figures
    left = [type(W._instances[k]).__name__ for k in set(W._instances) - before]
    assert set(left) <= {"PlotlyLib", "Layout"} and len(left) <= 2, left  # the shared plotly.js carrier
