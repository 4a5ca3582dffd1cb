"""Words and numbers that disagreed (issue 40, item 5), each against the panel that showed them: the plots' TTFT
p50 while no request had finished, the soft-reset count one refresh behind the board, an Apply that changed
max_requests_per_batch without saying so, and a shared block whose owners all show 0 cached."""

from __future__ import annotations

import dataclasses
import time

import pytest

import cbnb
from cbnb import ContinuousBatchingConfig
from cbnb.core.requests import RequestOutput, RequestState, RequestTimings
from cbnb.telemetry.events import Offload, RequestAdded
from cbnb.ui import ConfigPanel, KVPageMapPanel, LivePlotsPanel
from cbnb.ui.poller import Frame

from helpers_engine import TIMEOUT, tiny_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny:llama")


def _out(rid: str, state: RequestState, ttft: float | None, soft_resets: int = 0) -> RequestOutput:
    tm = RequestTimings(queued=100.0, scheduled=100.5, first_token=None if ttft is None else 100.0 + ttft)
    return RequestOutput(request_id=rid, state=state, prompt_token_ids=[5] * 8, token_ids=[7] * 3, text="",
                         max_new_tokens=16, timings=tm, num_soft_resets=soft_resets)


def test_plots_summary_gives_the_running_requests_ttft_and_the_boards_soft_resets(model):
    eng = cbnb.Engine(model, None, ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64))
    try:
        plots = LivePlotsPanel(eng, autostart=False)
        stats = eng.stats()  # nothing finished: the run's TTFT p50 is None, its soft resets 0
        assert stats["run"]["ttft_s"].get("p50") is None and stats["run"]["soft_resets"] == 0
        added = [RequestAdded(step=1, t=0.0, request_id=f"r{i}", prompt_tokens=8, max_new_tokens=16) for i in range(3)]
        # r2 was soft-reset in the step being planned: its own counter shows it, the run's events not yet
        reqs = [_out("r0", RequestState.DECODING, 8.4), _out("r1", RequestState.DECODING, 8.2),
                _out("r2", RequestState.PENDING, None, soft_resets=1)]
        plots._update(Frame(wall=time.time(), events=added, requests=reqs, stats=stats))
        sm = plots.summary
        assert sm["ttft_p50_ms"] == pytest.approx(8200.0) and sm["ttft_of"] == "2 running"
        assert sm["soft_resets"] == 1  # what the board shows for r2
        # the step's events arrive (the run counts it now): still 1, not 2
        stats2 = {**stats, "run": {**stats["run"], "soft_resets": 1}}
        plots._update(Frame(wall=time.time(), events=[Offload(2, 0.0, "r2", "soft_reset", "cache_full", 1, 8)],
                            requests=reqs, stats=stats2))
        assert plots.summary["soft_resets"] == 1
    finally:
        eng.stop()


def test_apply_lists_every_field_it_changed(model):
    eng = cbnb.Engine(model, None, ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=16)).start()
    try:
        before = eng.config.max_requests_per_batch
        panel = ConfigPanel(eng, autostart=False)
        panel.values = {**panel.values, "max_batch_tokens": 64}
        assert panel.apply(wait=True, timeout=TIMEOUT)
        after = eng.config.max_requests_per_batch
        assert after != before  # it follows max_batch_tokens while left automatic
        msg = panel.message
        assert "max_batch_tokens 16 -> 64" in msg, msg
        assert f"max_requests_per_batch {before} -> {after} (left automatic" in msg, msg
    finally:
        eng.stop()


def test_a_block_shared_by_requests_admitted_together_says_why_none_shows_it_cached(model):
    eng = cbnb.Engine(model, None, ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256,
                                                           allow_block_sharing=True)).start()
    try:
        prefix = list(range(3, 51))
        eng.pause()  # held between steps: the four are admitted in one step, and keep their pages while we look
        for i in range(4):
            eng.submit(prefix + [100 + i, 200 + i], max_new_tokens=150, ignore_eos=True)  # all fit: no soft reset
        end = time.monotonic() + TIMEOUT
        while not all(o.state.name == "DECODING" for o in eng.requests_snapshot()) and time.monotonic() < end:
            eng.step()
        kv = KVPageMapPanel(eng, autostart=False)
        kv.refresh()
        g = kv._snapshot.groups[0]
        shared = [b for b in range(g.num_blocks) if int(g.state[b]) == 2]
        assert shared, "the four prompts' common pages are shared"
        d = kv.details(0, shared[0])
        assert d["refcount"] == 4 and len(d["owners"]) == 4
        assert all(o.prefix_cached_tokens == 0 for o in eng.requests_snapshot())
        assert "admitted together" in d.get("note", ""), d
    finally:
        eng.stop()
