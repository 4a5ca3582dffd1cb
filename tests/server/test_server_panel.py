"""The dashboard's server panel, Python side (no browser): it follows servers as they start and stop, its counters
move with traffic, and its curl / openai snippets work when run as they are shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from cbnb.server import serve
from cbnb.ui import Dashboard, ServerPanel
from cbnb.ui.poller import Poller

from helpers_engine import TIMEOUT, torch_threads
from helpers_server import make_engine


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.stop()


def _values(panel):
    panel.poller.tick(force=True)
    return panel.servers


def test_panel_follows_servers_and_counts_traffic(engine):
    panel = ServerPanel(engine, poller=Poller(engine, idle_refresh_s=60))
    assert _values(panel) == []
    server = serve(engine, port=0, model_name="tiny")
    try:
        (s,) = _values(panel)
        assert s["url"] == server.url and s["model"] == "tiny" and not s["auth"] and not s["public"]
        assert s["counters"]["requests_total"] == 0
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
            for _ in range(3):
                assert c.post("/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            assert c.post("/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400
        (s,) = _values(panel)
        assert s["counters"]["requests_total"] == 3 and s["counters"]["errors"] == 1
        assert s["counters"]["requests_per_s"] > 0 and s["counters"]["in_flight"] == 0
        panel._on_copied({"which": "curl"})
        assert panel.message_kind == "ok" and "curl" in panel.message
    finally:
        server.stop()
    assert _values(panel) == []
    panel.close()


def test_snippets_run_as_shown(engine):
    server = serve(engine, port=0, model_name="tiny")
    panel = ServerPanel(engine, poller=Poller(engine, idle_refresh_s=60))
    try:
        (s,) = _values(panel)
        out = subprocess.run(["bash", "-c", s["snippets"]["curl"]], capture_output=True, text=True, timeout=60)
        body = json.loads(out.stdout)
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        py = subprocess.run([sys.executable, "-c", s["snippets"]["openai"]], capture_output=True, text=True,
                            timeout=120)
        assert py.returncode == 0, py.stderr
    finally:
        panel.close()
        server.stop()


def test_snippets_read_the_key_from_the_environment(engine):
    server = serve(engine, port=0, model_name="tiny", api_key="k-123")
    panel = ServerPanel(engine, poller=Poller(engine, idle_refresh_s=60))
    try:
        (s,) = _values(panel)
        assert s["auth"] and "k-123" not in json.dumps(s)  # never shown: a dashboard may be on a projector
        env = {**os.environ, "CBNB_API_KEY": "k-123"}
        out = subprocess.run(["bash", "-c", s["snippets"]["curl"]], capture_output=True, text=True, env=env,
                             timeout=60)
        assert json.loads(out.stdout)["usage"]["completion_tokens"] >= 1
        out = subprocess.run(["bash", "-c", s["snippets"]["curl"]], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "CBNB_API_KEY"})
        assert json.loads(out.stdout)["error"]["code"] == "invalid_api_key"
    finally:
        panel.close()
        server.stop()


def test_dashboard_has_the_server_panel(engine):
    d = Dashboard(engine, start=False)
    try:
        assert isinstance(d.server, ServerPanel) and d.server in d.panels and d.server in d.children
    finally:
        d.close()
