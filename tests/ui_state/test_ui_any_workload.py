"""Every panel's state survives any workload (issue 40, item 1): 10,000 requests, bursts larger than the row limits,
requests that never start, and a dashboard made half way through a run (it reads a suffix of the event log).

Property tests (hypothesis) over random event streams, over the simulator's own events and over a real engine's
(a tiny random model); a panel that cannot show everything says what it left out ("showing ... of ...")."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cbnb
from cbnb import ContinuousBatchingConfig
from cbnb.core.requests import RequestOutput, RequestState, RequestTimings
from cbnb.sim import SimEngine
from cbnb.telemetry.events import (BlocksAllocated, BlocksFreed, BlocksShared, Offload, RequestAdded, RequestDone,
                                   Restore, RunStarted, StepPlanned)
from cbnb.telemetry.explain import StoryBuilder
from cbnb.ui.series import SKIP_REASONS, StepSeries
from cbnb.ui.state import board_note, cap_live, encode_kv, request_blocks, request_rows
from cbnb.ui.timeline_state import TimelineState

from helpers_engine import tiny_model, torch_threads

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- random streams
def _ids(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


@st.composite
def event_streams(draw):
    """A random but well-formed-enough event stream: requests added (or never added: admitted before the panel),
    steps that take some and leave many out (bursts past any row limit), offloads, restores, ends, new runs, and
    steps counted from 1 again (another engine)."""
    n = draw(st.integers(1, 400))
    ids = _ids(n)
    events, step = [], 0
    for _ in range(draw(st.integers(1, 60))):
        what = draw(st.sampled_from(["add", "step", "step", "offload", "restore", "done", "blocks", "run", "restart"]))
        rid = draw(st.sampled_from(ids))
        if what == "add":
            events.append(RequestAdded(step=step, t=0.0, request_id=rid, prompt_tokens=draw(st.integers(0, 9000)),
                                       max_new_tokens=draw(st.none() | st.integers(1, 4096))))
        elif what in ("step", "restart"):
            step = 1 if what == "restart" else step + draw(st.integers(1, 700))
            taken = [(r, draw(st.sampled_from(["prefill", "decode"])), draw(st.integers(0, 20000)), 0, 0)
                     for r in draw(st.lists(st.sampled_from(ids), max_size=40))]
            skipped = [(draw(st.sampled_from(list(SKIP_REASONS) + ["no such reason"])),
                        draw(st.lists(st.sampled_from(ids), max_size=n)), {})
                       for _ in range(draw(st.integers(0, 3)))]
            events.append(StepPlanned(step=step, t=0.0, taken=taken, skipped=skipped,
                                      token_budget=draw(st.integers(0, 8192)), tokens_used=len(taken)))
        elif what == "offload":
            events.append(Offload(step=step, t=0.0, request_id=rid, path=draw(st.sampled_from(["swap", "reset"])),
                                  reason="cache_full", blocks_freed=3, tokens_to_recompute=40))
        elif what == "restore":
            events.append(Restore(step=step, t=0.0, request_id=rid, blocks=3))
        elif what == "done":
            events.append(RequestDone(step=step, t=0.0, request_id=rid,
                                      state=draw(st.sampled_from(["FINISHED", "FAILED", "CANCELLED", "ODD"]))))
        elif what == "blocks":
            events.append(draw(st.sampled_from([
                BlocksAllocated(step=step, t=0.0, request_id=rid, blocks=[[1, 2], [3]]),
                BlocksShared(step=step, t=0.0, request_id=rid, blocks=[4, 5], refcounts=[2, 2]),
                BlocksFreed(step=step, t=0.0, request_id=rid, freed=[[1, 2]])])))
        else:
            events.append(RunStarted(step=step, t=0.0, cause="workload", label="w"))
    return events


def _check_timeline(events, max_rows, max_steps, split):
    tl = TimelineState(max_rows=max_rows, max_steps=max_steps)
    tl.add_events(events[:split])
    tl.add_events(events[split:])
    meta, first, ncols, cells = tl.encode()
    assert len(meta) <= max_rows and ncols <= max_steps
    assert len(cells) == (len(meta) * ncols if meta and ncols else 0)
    assert len(tl.rows) <= tl.total_requests or not tl.rows
    if tl.total_requests > len(tl.rows):
        assert f"of {tl.total_requests:,} requests" in tl.note()
    else:
        assert tl.note() == ""
    for m in meta[:3]:
        if ncols:
            tl.details(m["id"], first + ncols - 1)  # never raises inside the window
    tl.prune_offloads()
    return tl


@PROPS
@given(events=event_streams(), max_rows=st.integers(1, 64), max_steps=st.integers(1, 64), split=st.integers(0, 60))
def test_timeline_takes_any_event_stream(events, max_rows, max_steps, split):
    _check_timeline(events, max_rows, max_steps, split)


@PROPS
@given(events=event_streams(), size=st.integers(1, 50))
def test_plot_series_take_any_event_stream(events, size):
    s = StepSeries(size=size)
    s.add_events(events)
    assert len(s) <= size
    s.arrays()


@PROPS
@given(events=event_streams(), pick=st.integers(0, 399))
def test_why_story_takes_any_event_stream(events, pick):
    b = StoryBuilder(f"r{pick}", None)
    b.feed(events)
    story = b.story(None)
    story.text()
    story.to_dict()


def _out(rid: str, state: RequestState, n: int = 0) -> RequestOutput:
    return RequestOutput(request_id=rid, state=state, prompt_token_ids=[5] * 4, token_ids=[7] * n, text="",
                         max_new_tokens=8, timings=RequestTimings())


@PROPS
@given(states=st.lists(st.sampled_from(list(RequestState)), max_size=3000), max_live=st.integers(1, 300),
       max_finished=st.integers(0, 64))
def test_board_caps_live_and_ended_rows_and_says_so(states, max_live, max_finished):
    outs = [_out(f"r{i}", s) for i, s in enumerate(states)]
    rows, counts, hidden = request_rows(outs, max_finished)
    rows, hidden_live = cap_live(rows, max_live)
    live = sum(n for s, n in counts.items() if s not in ("FINISHED", "FAILED", "CANCELLED"))
    live_rows = [r for r in rows if r[1] not in ("FINISHED", "FAILED", "CANCELLED")]
    assert len(live_rows) == min(live, max_live) and hidden_live == live - len(live_rows)
    assert len(rows) - len(live_rows) == min(max_finished, len(outs) - live) and sum(counts.values()) == len(outs)
    note = board_note(counts, hidden_live, hidden)
    assert (f"of {live:,} live requests" in note) if hidden_live else note == ""
    # when some are left out, the running requests are listed before the waiting ones
    kinds = [r[1] == "PENDING" for r in live_rows]
    assert kinds == sorted(kinds) or not hidden_live


# ---------------------------------------------------------------------------------------------- the simulator
def _sim(num_blocks: int, max_batch_tokens: int) -> SimEngine:
    return SimEngine("smollm2-135m", "h100-sxm", ContinuousBatchingConfig(
        page_size=16, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, max_memory_percent=0.3))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 700), num_blocks=st.integers(8, 256), mbt=st.sampled_from([16, 64, 512]),
       max_rows=st.integers(1, 300), seed_from=st.floats(0, 1), data=st.data())
def test_simulated_streams_feed_every_panel_state(n, num_blocks, mbt, max_rows, seed_from, data):
    """A simulated burst (all at once: most wait; some never start because the cache is too small for them), read
    whole or from half way (a dashboard made mid-run)."""
    sim = _sim(num_blocks, mbt)
    lens = data.draw(st.lists(st.integers(1, 600), min_size=n, max_size=n))
    for i, p in enumerate(lens):
        sim.submit([3 + (i + k) % 500 for k in range(p)], max_new_tokens=1 + i % 9, ignore_eos=True)
    sim.run(max_steps=data.draw(st.integers(1, 200)))
    events, _, _ = sim.events.since(0)
    tail = events[int(seed_from * len(events)):]
    tl = _check_timeline(tail, max_rows, 500, len(tail) // 2)
    StepSeries(size=240).add_events(tail)
    snap = sim.snapshot()
    encode_kv(snap)
    for rid in list(tl.rows)[:3] + ["never-seen"]:
        request_blocks(snap, rid)
        b = StoryBuilder(rid, sim.config)
        b.feed(tail)
        b.story(None).text()
    rows, counts, hidden = request_rows(sim.requests_snapshot())
    rows, hidden_live = cap_live(rows, 200)
    assert len([r for r in rows if r[1] not in ("FINISHED", "FAILED", "CANCELLED")]) <= 200


def test_ten_thousand_simulated_requests_on_the_timeline_board_and_kv_map():
    """The acceptance test: a dashboard over 10,000 simulated requests (made after they arrived, as in notebook
    05), then stepped: no exception, and the timeline and the board say what they leave out."""
    from cbnb.ui import Dashboard

    sim = _sim(2048, 2048)
    for i in range(10_000):
        sim.submit([3 + (i + k) % 500 for k in range(16 + i % 200)], max_new_tokens=1 + i % 16, ignore_eos=True)
    sim.run(max_steps=5)  # the dashboard below reads a log that starts with these requests running
    d = Dashboard(sim, start=False)
    try:
        for _ in range(3):
            sim.run(max_steps=20)
            d.poller.tick(force=True)
        assert d.poller.errors == []
        assert 0 < len(d.timeline.rows) <= d.timeline.timeline.max_rows
        assert "showing the newest" in d.timeline.note and "of 10,000 requests" in d.timeline.note
        live = [r for r in d.board.rows if r[1] not in ("FINISHED", "FAILED", "CANCELLED")]
        assert len(live) == 200 and "of " in d.board.note and "live requests" in d.board.note
        assert d.kvmap.groups and len(d.kvmap.cells) == sum(g["num_blocks"] for g in d.kvmap.groups)
        assert d.plots.series_arrays()
    finally:
        d.close()


def test_dashboard_over_notebook_05s_real_size_does_not_raise():
    """Issue 40's crash: `Dashboard(sim)` after a capacity run of more waiting requests than the timeline's rows."""
    from cbnb.lab import traffic as tr
    from cbnb.lab.workloads import synthetic
    from cbnb.sim import load_profile, load_shape
    from cbnb.tuning import measure_capacity
    from cbnb.ui import Dashboard

    shape = load_shape("llama-3.1-8b")
    sim = SimEngine(shape, load_profile("h100-sxm"), ContinuousBatchingConfig(max_memory_percent=0.3))
    reqs = synthetic("long-chat", 600, tr.Poisson(1.0), tr.LogNormal(2048, 0.6, 64, 6144),
                     tr.LogNormal(512, 0.6, 16, 2048), model="shape:llama-3.1-8b", vocab_size=shape.vocab_size)
    measure_capacity(sim, reqs, repeats=1)
    d = Dashboard(sim, start=False)
    try:
        d.poller.tick(force=True)
        assert d.poller.errors == [] and d.timeline.rows
    finally:
        d.close()


# ---------------------------------------------------------------------------------------------- a real engine
@pytest.fixture(scope="module")
def real_events():
    """One real engine's event stream (a tiny random model, a cache too small for the burst: waits, soft resets,
    a request too long to ever start, a cancelled one)."""
    with torch_threads(1):
        eng = cbnb.Engine(tiny_model("tiny:llama"), None, ContinuousBatchingConfig(
            page_size=16, num_blocks=24, max_batch_tokens=32, cpu_offload_space=0.0)).start()
        try:
            hs = [eng.submit([3 + (i + k) % 200 for k in range(8 + 5 * (i % 9))], max_new_tokens=6 + i % 11,
                             ignore_eos=True) for i in range(40)]
            hs[-1].cancel()
            for h in hs:
                h.result(timeout=600)
            events, _, _ = eng.events.since(0)
            snap = eng.snapshot()
        finally:
            eng.stop()
    return events, snap


@PROPS
@given(start=st.floats(0, 1), split=st.floats(0, 1), max_rows=st.integers(1, 50), max_steps=st.integers(1, 80),
       size=st.integers(1, 30))
def test_real_engine_streams_from_any_point_feed_every_panel_state(real_events, start, split, max_rows, max_steps,
                                                                   size):
    events, snap = real_events
    tail = events[int(start * len(events)):]
    tl = _check_timeline(tail, max_rows, max_steps, int(split * len(tail)))
    s = StepSeries(size=size)
    s.add_events(tail)
    assert len(s) <= size
    for rid in list(tl.rows)[:2]:
        b = StoryBuilder(rid, None)
        b.feed(tail)
        b.story(None).text()
        request_blocks(snap, rid)
