"""A dashboard whose engine the notebook replaced (the engine cell re-run) or stopped says so, and its Submit refuses
to send a prompt there (issue 40, item 6); its repr no longer says "poller=running" over a stopped engine."""

from __future__ import annotations

import pytest

import cbnb
import cbnb.ui.binding
from cbnb import ContinuousBatchingConfig
from cbnb.ui import Dashboard

from helpers_engine import tiny_model
from test_ui_panels import FakeTokenizer

CFG = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny:llama")


@pytest.fixture
def engines(model):
    made = []

    def make():
        made.append(cbnb.Engine(model, FakeTokenizer(), CFG))
        return made[-1]

    yield make
    for e in made:
        e.stop()


@pytest.fixture
def ns(monkeypatch):
    space: dict = {}
    monkeypatch.setattr(cbnb.ui.binding, "_user_ns", lambda: space)
    return space


def test_a_replaced_engine_is_said_and_submit_refuses(ns, engines):
    old = ns["engine"] = engines()
    d = Dashboard(old, start=False)
    try:
        assert d.submit.submit("hello there", max_new_tokens=2) is not None  # still the notebook's engine
        ns["engine"] = engines()  # the engine cell re-run
        before = len(old.requests_snapshot())
        assert d.submit.submit("hello there", max_new_tokens=2) is None
        assert "`engine` now names another engine" in d.submit.message and d.submit.message_kind == "error"
        assert d.submit.run_workload("cpu-32", 0.1) == []
        assert len(old.requests_snapshot()) == before  # nothing went to the old engine
        d.poller.tick(force=True)
        assert "now names another engine" in d.controls.message and d.controls.message_kind == "error"
        assert "replaced: `engine` names another engine" in repr(d)
    finally:
        d.close()


def test_a_stopped_engine_is_said_in_the_repr_the_controls_and_submit(ns, engines):
    eng = ns["eng"] = engines().start()
    d = Dashboard(eng, start=True)
    try:
        assert "poller=running" in repr(d)
        eng.stop()
        assert eng.state == "stopped"
        r = repr(d)
        assert "poller=running" not in r and "engine stopped" in r
        assert d.submit.submit("hello there", max_new_tokens=2) is None and "stopped" in d.submit.message
        d.poller.tick(force=True)
        assert "engine is stopped" in d.controls.message
    finally:
        d.close()


def test_outside_a_kernel_nothing_is_watched(engines):
    eng = engines()
    d = Dashboard(eng, start=False)
    try:
        assert d.binding.names == [] and d.binding.note() == ""
        assert d.submit.submit("hello there", max_new_tokens=2) is not None
    finally:
        d.close()
