"""What the teacher's browser trial of the notebooks found in the panels' state (issue 40's closing trial), checked
without a browser."""

from __future__ import annotations

from cbnb import ContinuousBatchingConfig
from cbnb.sim import SimEngine, load_profile, load_shape
from cbnb.ui.state import ended_not_kept


def test_board_counts_the_ended_requests_the_engine_no_longer_lists():
    """After notebook 05's sweep the board said "256 finished · 192 older ended requests not listed" while the
    timeline said "of 13,785 requests": the engine's snapshot keeps its newest 256 ended requests, and the board
    counted only those. It now adds the older ones from the engine's cumulative counters."""
    from cbnb.ui import Dashboard

    sim = SimEngine(load_shape("smollm2-135m"), load_profile("h100-sxm"), ContinuousBatchingConfig())
    for i in range(600):
        sim.submit([3 + (i + k) % 500 for k in range(16 + i % 40)], max_new_tokens=1 + i % 4, ignore_eos=True)
    sim.run()
    hs = [sim.submit([5] * 20, max_new_tokens=2) for _ in range(3)]
    for h in hs:
        sim.cancel(h.request_id)
    d = Dashboard(sim, start=False)
    try:
        d.poller.tick(force=True)
        assert d.poller.errors == []
        assert d.board.counts["FINISHED"] == 600 and d.board.counts["CANCELLED"] == 3
        listed = sum(1 for r in d.board.rows if r[1] in ("FINISHED", "FAILED", "CANCELLED"))
        assert d.board.hidden == 603 - listed
    finally:
        d.close()


def test_ended_not_kept_adds_nothing_without_counters_or_when_all_are_listed():
    counts = {"FINISHED": 5, "FAILED": 0, "CANCELLED": 1, "PENDING": 2}
    assert ended_not_kept(counts, None) == {} and ended_not_kept(counts, {}) == {}
    assert ended_not_kept(counts, {"requests_finished": 5, "requests_cancelled": 1}) == {}
    assert ended_not_kept(counts, {"requests_finished": 9, "requests_failed": 2, "requests_cancelled": 1}) == \
        {"FINISHED": 4, "FAILED": 2}


def test_a_simulations_token_stream_says_how_many_tokens_not_placeholder_ids():
    """The teacher's trial saw notebook 05's token stream read "42 42 42 ..." (the simulator's placeholder token,
    one per generated token). A simulation's stream now says how many tokens each request has; a real engine without
    a tokenizer still shows its ids."""
    from cbnb.ui import Dashboard
    from cbnb.ui.state import TextTracker

    sim = SimEngine(load_shape("smollm2-135m"), load_profile("h100-sxm"), ContinuousBatchingConfig())
    sim.submit([5] * 20, max_new_tokens=3, ignore_eos=True)
    sim.submit([6] * 20, max_new_tokens=1, ignore_eos=True)
    sim.run()
    d = Dashboard(sim, start=False)
    try:
        d.poller.tick(force=True)
        assert d.poller.errors == []
        texts = sorted(item["text"] for item in d.stream.items)
        assert texts == ["1 token (simulated: no text)", "3 tokens (simulated: no text)"], texts
    finally:
        d.close()
    assert TextTracker(None).text("a", [42, 42]) == "42 42"
