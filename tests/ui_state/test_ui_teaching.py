"""The teaching panels' Python side (no browser): timeline, "Why?", step-mode controls, KV highlight, board cancel,
config lock, run segments. Front-end actions are simulated by the messages the ES modules send."""

from __future__ import annotations

import time

import numpy as np
import pytest

import cbnb
from cbnb.telemetry.events import Offload, RequestAdded, RequestDone, Restore, RunStarted, StepPlanned
from cbnb.ui import (ConfigPanel, ControlsPanel, Dashboard, KVPageMapPanel, RequestBoardPanel, SubmitPanel,
                     TimelinePanel, WhyPanel)
from cbnb.ui.poller import Poller
from cbnb.ui.series import RunSegments, StepSeries, TimeSeries
from cbnb.ui.state import prompt_label, request_blocks
from cbnb.ui.timeline_state import KINDS, TimelineState

from helpers_engine import TIMEOUT, paused, tiny_model
from test_ui_panels import FakeTokenizer, ids, msg, wait_for
from test_ui_state import stats

CFG = dict(page_size=16, num_blocks=64, max_batch_tokens=16)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture
def engine():
    eng = cbnb.Engine(tiny_model("tiny:llama"), FakeTokenizer(), cbnb.ContinuousBatchingConfig(**CFG))
    eng.start()
    yield eng
    eng.stop()


def kinds_of(panel: TimelinePanel, rid: str) -> list[str]:
    rows = [r["id"] for r in panel.rows]
    n = panel.num_steps
    i = rows.index(rid)
    return [KINDS[c & 15] for c in panel.cells[i * n:(i + 1) * n]]


# ---------------------------------------------------------------------------------------------- timeline
def test_timeline_state_codes_swaps_resets_ends_and_evicts_oldest_rows():
    ts = TimelineState(max_rows=2, max_steps=4)
    ts.add_events([RequestAdded(0, 0.0, "a", 40, 8), RequestAdded(0, 0.0, "b", 40, 8),
                   StepPlanned(1, 0.0, "fifo", [("a", "prefill", 16, 0, 0)],
                               [("token_budget", ["b"], {"budget_tokens": 16, "left_tokens": 0})], [], 16, 16, 16, 0),
                   Offload(1, 0.0, "a", "swap", "cache full", 2, 0),
                   StepPlanned(2, 0.0, "fifo", [("b", "prefill", 8, 0, 0)],
                               [("no_free_blocks", ["a"], {"needed_blocks": (2,), "available_blocks": (0,)})], [],
                               16, 8, 8, 0),
                   Restore(3, 0.0, "a", 2),
                   StepPlanned(3, 0.0, "fifo", [("a", "decode", 1, 16, 0)], [], [], 16, 1, 0, 1),
                   Offload(3, 0.0, "b", "soft_reset", "cache full", 1, 8),
                   RequestDone(3, 0.0, "a", "FINISHED", 8)])
    meta, first, n, cells = ts.encode()
    assert [m["id"] for m in meta] == ["a", "b"] and (first, n) == (1, 3)
    grid = np.frombuffer(cells, dtype=np.uint8).reshape(2, 3)
    assert [KINDS[c & 15] for c in grid[0]] == ["swapped_out", "in_swap", "finished"]
    assert [KINDS[c & 15] for c in grid[1]] == ["waiting", "prefill", "soft_reset"]
    assert grid[1, 1] >> 4 == 8 and grid[1, 0] >> 4 == 0  # 8 of 16 budget tokens -> 8/15; reason index 0
    d = ts.details("a", 2)
    assert d["cell"] == "in_swap" and d["reason"] == "no_free_blocks" and "needs 2 more blocks" in d["numbers"]
    assert ts.details("b", 3)["offload"] == "soft_reset" and ts.details("b", 3)["tokens_to_recompute"] == 8
    with pytest.raises(ValueError, match="not on the timeline"):
        ts.details("zz", 2)
    ts.add_events([RequestAdded(3, 0.0, "c", 5, 1)])  # a third request pushes the oldest row out
    assert [m["id"] for m in ts.encode()[0]] == ["b", "c"]
    for s in range(4, 9):  # the window keeps the newest 4 steps
        ts.add_events([StepPlanned(s, 0.0, "fifo", [("c", "decode", 1, 5, 0)], [], [], 16, 1, 0, 1)])
    assert ts.window() == (5, 4)
    with pytest.raises(ValueError, match="window"):
        ts.details("c", 2)


def test_timeline_encode_time_at_256_requests_by_500_steps():
    """Python's share of the timeline at its bound: fold one step of 256 requests, and encode the cells."""
    ts = TimelineState(256, 500)
    rids = [f"r{i}" for i in range(256)]
    ts.add_events([RequestAdded(0, 0.0, r, 100, 32) for r in rids])
    steps = [StepPlanned(s, 0.0, "fifo", [(r, "decode", 1, 100, 0) for r in rids[:128]],
                         [("token_budget", rids[128:], {"budget_tokens": 128, "left_tokens": 0})], [], 128, 128, 0, 128)
             for s in range(1, 501)]
    t0 = time.perf_counter()
    ts.add_events(steps)
    fold_ms = 1000 * (time.perf_counter() - t0) / len(steps)
    t0 = time.perf_counter()
    for _ in range(10):
        meta, first, n, cells = ts.encode()
    encode_ms = 100 * (time.perf_counter() - t0)
    print(f"timeline 256x500: fold {fold_ms:.3f} ms/step, encode {encode_ms:.2f} ms")
    assert len(cells) == 256 * 500 and n == 500 and first == 1
    grid = np.frombuffer(cells, dtype=np.uint8).reshape(256, 500)
    assert (grid[:128] & 15 == 3).all() and (grid[128:] & 15 == 1).all()


def test_timeline_panel_follows_an_engine_and_answers_hover(engine):
    poller = Poller(engine)
    tl = TimelinePanel(engine, poller=poller)
    with paused(engine):
        a = engine.submit("Explain paging", max_new_tokens=3, eos_token_id=-1)
        b = engine.submit(ids(40), max_new_tokens=2, eos_token_id=-1)
    a.result(TIMEOUT), b.result(TIMEOUT)
    poller.tick(force=True)
    ka = kinds_of(tl, a.request_id)
    # 31 prompt tokens in chunks of 16 and 15 (the second samples token 1), a decode (token 2), then the step of
    # token 3, where it also finished.
    assert ka[:4] == ["prefill", "prefill", "decode", "finished"], ka
    assert "waiting" in kinds_of(tl, b.request_id)
    label = {r["id"]: r["label"] for r in tl.rows}
    assert label[a.request_id] == "Explain paging" and label[b.request_id].startswith("fghij")  # ids decoded
    step = tl.first_step + ka.index("prefill")
    replies = []
    tl.send = lambda content, buffers=None: replies.append(content)
    msg(tl, kind="hover", id=a.request_id, step=step, seq=3)
    r = replies[-1]
    assert r["seq"] == 3 and r["phase"] == "prefill" and r["tokens"] == 16 and r["start"] == 0 and r["blocks"] >= 1
    msg(tl, kind="hover", id=a.request_id, step=10_000, seq=4)
    assert "window" in replies[-1]["error"]


# ---------------------------------------------------------------------------------------------- series
def test_time_series_breaks_lines_at_idle_gaps_and_new_segments():
    ts = TimeSeries(t0=0.0)
    ts.add_stats(1.0, stats(0), step=10, run=0)
    ts.add_stats(1.5, stats(5), step=12, run=0)
    ts.add_stats(20.0, stats(5), step=12, run=0)  # 18.5 s without a new step: idle
    ts.add_stats(20.2, stats(9), step=13, run=0)
    ts.add_stats(20.4, stats(12), step=14, run=1)  # a new segment
    step = ts.column("step")
    assert np.isnan(step).tolist() == [False, False, True, False, False, True, False]
    assert ts.column("run")[-1] == 1


def test_run_segments_from_events_merge_a_reconfigure_and_its_reset():
    runs = RunSegments("start", t0=0.0)
    s = StepSeries(8, runs=runs)
    s.add_events([StepPlanned(1, 0.5, "fifo", [], [], [], 16, 0, 0, 0),
                  RunStarted(1, 0.6, "reconfigure", "page_size=16"), RunStarted(1, 0.6, "reset_stats", ""),
                  StepPlanned(2, 0.7, "fifo", [], [], [], 16, 0, 0, 0)])
    assert [(m["index"], m["step"], m["cause"], m["label"]) for m in runs.to_list()] == [
        (0, 0, "start", "start"), (1, 1, "reconfigure", "page_size=16")]
    assert s.column("run").tolist() == [0, 1] and s.column("t").tolist() == [0.5, pytest.approx(0.7)]


def test_reconfigure_and_workload_start_labelled_runs(engine):
    d = Dashboard(engine, start=False)
    try:
        engine.generate([ids(10)], max_new_tokens=2, timeout=TIMEOUT)
        d.config.set(page_size=32, num_blocks=32)
        assert d.config.apply(wait=True)
        assert "no request was running" in d.config.message
        engine.generate([ids(10)], max_new_tokens=2, timeout=TIMEOUT)  # a marker right after another merges into it
        d.submit.run_workload("cpu-32", scale=0.07)
        wait_for(lambda: not engine.core.requests and engine.events.cursor > 0, TIMEOUT)
        d.poller.tick(force=True)
        runs = d.plots.runs
        assert [r["cause"] for r in runs] == ["start", "reconfigure", "workload"], runs
        assert "page_size=32" in runs[1]["label"] and "num_blocks=32" in runs[1]["label"]
        assert runs[2]["label"] == "workload cpu-32 (scale 0.07)" and d.plots.summary["run_index"] == 2
    finally:
        d.close()


# ---------------------------------------------------------------------------------------------- step mode panel
def test_pause_pokes_the_poller_again_once_the_loop_holds(engine):
    """The step running at the click applies after the first poke; a second poke once the loop holds lets the panel
    name that step ("paused after step N") without waiting for the next poll (a teacher saw it one poll stale)."""
    poller = Poller(engine)
    c = ControlsPanel(engine, poller=poller)
    held_at_poke: list[bool] = []
    poller.poke = lambda: held_at_poke.append(engine._loop.parked.is_set())
    hs = [engine.submit(ids(30), max_new_tokens=60, eos_token_id=-1) for _ in range(4)]
    try:
        wait_for(lambda: engine.core.step_id > 2, TIMEOUT)
        msg(c, kind="pause")
        wait_for(lambda: True in held_at_poke, TIMEOUT)
        assert engine.paused and c.paused
    finally:
        engine.resume()
    for h in hs:
        h.result(timeout=TIMEOUT)


def test_controls_pause_step_resume_and_font_scale(engine):
    poller = Poller(engine)
    c = ControlsPanel(engine, poller=poller)
    msg(c, kind="pause")
    assert engine.paused and c.paused and "Paused" in c.message
    h = engine.submit(ids(30), max_new_tokens=2, eos_token_id=-1)
    wait_for(lambda: any(o.state.name == "PENDING" for o in engine.requests_snapshot()))
    poller.tick(force=True)
    assert c.waiting == 1 and c.paused
    assert c.step(wait=True)
    assert c.message.startswith("Step ") and "prefill 16 tokens" in c.message and c.message.endswith("Paused.")
    poller.tick(force=True)
    assert c.last_step >= 1 and not c.stepping
    msg(c, kind="rate", value=5)
    assert engine.step_rate == 5.0 and c.step_rate == 5.0
    msg(c, kind="rate", value=0)
    assert engine.step_rate is None
    msg(c, kind="resume")
    assert not engine.paused and h.result(TIMEOUT).state.name == "FINISHED"
    c.font_scale = 3
    assert c.font_scale == 2.0
    c.font_scale = 0.5
    assert c.font_scale == 1.0


# ---------------------------------------------------------------------------------------------- why, selection
def test_selection_opens_the_story_and_highlights_blocks(engine):
    d = Dashboard(engine, start=False)
    try:
        with paused(engine):
            a = engine.submit(ids(40), max_new_tokens=200, ignore_eos=True)
            b = engine.submit(ids(40), max_new_tokens=200, ignore_eos=True)  # same prompt: shares a's blocks
        wait_for(lambda: [len(o.token_ids) >= 2 for o in engine.requests_snapshot()] == [True, True], TIMEOUT)
        assert engine.pause(timeout=TIMEOUT)  # hold it: the page map and the tables below are of the same step
        d.poller.tick(force=True)
        msg(d.kvmap, kind="visible", view="v", on=True)
        d.poller.tick(force=True)
        msg(d.board, kind="select", id=b.request_id)  # a click on a board row
        assert d.why.request_id == b.request_id and d.board.selected == b.request_id
        assert d.timeline.selected == b.request_id and d.stream.selected == b.request_id
        kinds = [e["kind"] for e in d.why.story["entries"]]
        assert kinds[0] == "arrival" and "decode" in kinds and d.why.story["state"] == "DECODING"
        hl = d.kvmap.highlight
        table = engine.cache.allocators[0].table(b.request_id)
        assert hl["mode"] == "select" and hl["blocks"][0] == sorted(table) and hl["count"] == len(table)
        assert hl["co_owners"] == {a.request_id: len(hl["shared"][0])} and len(hl["shared"][0]) >= 2
        # The story grows while the request runs (only new events are read).
        n0 = d.why.story["output_tokens"]
        engine.resume()
        wait_for(lambda: len(next(o for o in engine.requests_snapshot() if o.request_id == b.request_id).token_ids)
                 > n0 + 3)
        d.poller.tick(force=True)
        assert d.why.story["output_tokens"] > n0
        # Hovering a KV block of a highlights a's blocks; leaving falls back to the selection.
        block = engine.cache.allocators[0].table(a.request_id)[-1]
        d.kvmap.send = lambda content, buffers=None: None
        msg(d.kvmap, kind="hover", group=0, block=block, seq=1)
        assert d.kvmap.highlight["request_id"] == a.request_id and d.kvmap.highlight["mode"] == "hover"
        msg(d.kvmap, kind="hover_request", id=None)
        assert d.kvmap.highlight["request_id"] == b.request_id
        msg(d.kvmap, kind="click", group=0, block=block)  # a click on a block selects its owner
        assert d.why.request_id == a.request_id
        msg(d.why, kind="close")
        assert d.why.request_id == "" and d.kvmap.highlight == {} and d.board.selected == ""
        msg(d.board, kind="cancel_all")
        assert "Cancelled 2 unfinished requests" in d.board.message
        assert a.result(TIMEOUT).state.name == "CANCELLED" and b.result(TIMEOUT).state.name == "CANCELLED"
    finally:
        d.close()


def test_request_blocks_of_a_request_without_blocks():
    from helpers_ui import synthetic_snapshot

    snap = synthetic_snapshot(100, n_requests=5)
    hl = request_blocks(snap, "nobody")
    assert hl["count"] == 0 and hl["blocks"] == [[]]
    owner0 = request_blocks(snap, "req-0")
    assert owner0["count"] == len(owner0["blocks"][0]) > 0


# ---------------------------------------------------------------------------------------------- board, submit
def test_board_cancel_one_and_prompt_words(engine):
    poller = Poller(engine)
    board = RequestBoardPanel(engine, poller=poller)
    h = engine.submit("What is   a KV cache?", max_new_tokens=300, ignore_eos=True)
    wait_for(lambda: any(o.state.name == "DECODING" for o in engine.requests_snapshot()))
    poller.tick(force=True)
    cols = list(board.columns)
    row = next(r for r in board.rows if r[0] == h.request_id)
    assert row[cols.index("prompt_text")] == "What is a KV cache?"
    msg(board, kind="cancel", id=h.request_id)
    assert board.message_kind == "ok" and h.result(TIMEOUT).state.name == "CANCELLED"
    msg(board, kind="cancel_all")
    assert board.message == "No unfinished request to cancel."
    assert prompt_label(h.result()) == "What is a KV cache?"
    long = "word " * 40
    out = engine.submit(long, max_new_tokens=1).result(TIMEOUT)
    assert prompt_label(out).endswith("…") and len(prompt_label(out)) == 80


def test_submit_says_the_cap_and_why(engine):
    engine.max_positions = 64  # the tiny model's own limit is larger; a small one shows the cap
    p = SubmitPanel(engine, autostart=False)
    h = p.submit("hello", max_new_tokens=100_000)
    n = len(h.prompt_token_ids)
    assert h.max_new_tokens == 64 - n
    assert f"up to {64 - n} new tokens (asked 100000: the model's 64 max positions minus the {n} prompt tokens)" \
        in p.message
    h.cancel()


# ---------------------------------------------------------------------------------------------- config
def test_config_lock_keeps_cache_bytes_and_invalid_edits_have_no_code(engine):
    p = ConfigPanel(engine, autostart=False)
    tokens_before, kv_before = p.memory["capacity_tokens"], p.memory["proposed"]["kv_cache"]
    per_token = kv_before / ((64 + 2) * 16)  # 64 blocks + the 2 reserved padding blocks, of 16 tokens

    def same_bytes():  # the usable cache keeps its bytes; only the two padding blocks follow the page size
        pad = 2 * p.values["page_size"] * per_token
        return p.memory["capacity_tokens"] == tokens_before and p.memory["proposed"]["kv_cache"] - pad == \
            pytest.approx(kv_before - 2 * 16 * per_token)

    p.lock_bytes = True
    p.set(page_size=32)
    assert p.values["num_blocks"] == 32 and "num_blocks 64 -> 32" in p.message and same_bytes()
    p.set(page_size=8)
    assert p.values["num_blocks"] == 128 and same_bytes()
    p.lock_bytes = False
    p.set(page_size=16)
    assert p.values["num_blocks"] == 128
    p.set(num_blocks=10**9)  # cannot be sized
    assert p.memory["error"] and p.code == ""  # never the code of older values
    msg(p, kind="reset")
    assert "num_blocks=64" in p.code and not p.memory["error"]
    cuda = [f["name"] for f in p.fields if f.get("cuda_only")]
    assert set(cuda) == {"q_padding_interval_size", "kv_padding_interval_size", "use_cuda_graph",
                         "use_async_batching"}
    assert {f["group"] for f in p.fields} == {"cache", "scheduling"}


def test_config_apply_mid_run_says_what_happens_to_unfinished_requests(engine):
    poller = Poller(engine)
    p = ConfigPanel(engine, poller=poller)
    h = engine.submit(ids(30), max_new_tokens=60, ignore_eos=True)
    wait_for(lambda: any(len(o.token_ids) >= 2 for o in engine.requests_snapshot()))
    p.set(max_batch_tokens=32)
    assert p.apply(wait=True), p.message
    assert "1 unfinished request kept, their KV" in p.message and "recomputed in the new cache" in p.message
    assert h.result(TIMEOUT).state.name == "FINISHED" and len(h.result().token_ids) == 60
    story = engine.explain(h.request_id)
    assert any(e.kind == "reconfigure" for e in story.entries)
    assert any(e.kind == "prefill" and e.reason == "recompute" for e in story.entries)
