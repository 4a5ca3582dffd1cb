"""How long a served engine lives: `engine.serve()` from a cell, re-runs on a port, `engine.stop()` stopping its
servers itself, the running server holding its engine, a stopped one letting go, and interpreter exit (tiny:llama)."""

from __future__ import annotations

import gc
import pathlib
import subprocess
import sys
import textwrap
import threading
import weakref

import httpx
import pytest

import cbnb
from cbnb.server import Server, lifecycle, servers_for

from helpers_engine import TIMEOUT, torch_threads
from helpers_server import make_engine, slow_steps

REPO = pathlib.Path(__file__).resolve().parents[2]
CELL = """engine = make_engine()
server = engine.serve(port=PORT, model_name="tiny")
"""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_of(port: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"cbnb-server-{port}"]


def _complete(url: str) -> dict:
    r = httpx.post(url + "/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _loop_thread(engine: cbnb.Engine) -> threading.Thread:
    t = engine._thread
    assert t is not None and t.is_alive()
    return t


def test_rerunning_a_serving_cell_replaces_the_server_and_frees_the_old_engine():
    port = _free_port()
    ns = {"make_engine": make_engine, "PORT": port}
    exec(CELL, ns)
    first, first_server = weakref.ref(ns["engine"]), ns["server"]
    first_loop = _loop_thread(ns["engine"])
    assert isinstance(first_server, Server) and first_server.url == f"http://127.0.0.1:{port}/v1"
    _complete(first_server.url)
    del first_server
    exec(CELL, ns)  # the same cell again: a new engine on the same port
    try:
        server = ns["server"]
        assert server.running and server.port == port and servers_for(ns["engine"]) == [server]
        assert len(_threads_of(port)) == 1
        assert _complete(server.url)["usage"]["completion_tokens"] == 3
        gc.collect()  # the old server's app, routes and uvicorn objects hold each other in cycles
        assert first() is None, "the replaced server still holds its engine"
        first_loop.join(TIMEOUT)
        assert not first_loop.is_alive()  # the old engine's finalizer stopped its loop
    finally:
        ns["engine"].stop()
    assert not ns["server"].running and _threads_of(port) == []


def test_engine_stop_stops_its_servers_itself(monkeypatch):
    monkeypatch.setattr(lifecycle, "_WATCH_S", 3600.0)  # the watcher would take an hour: stop() must not need it
    engine = make_engine()
    slow_steps(engine, 0.02)
    a, b = engine.serve(port=0), engine.serve(port=0)
    # greedy, EOS ignored: 500 tokens take > 10 s, so the request is surely live at stop(). Sampled at the default
    # temperature, the tiny model draws EOS about once in 512 tokens (14 of 300 sampled requests ended within 30
    # tokens): one CI run saw the stream end by itself, with no cancel event.
    body = {"prompt": "hi", "max_tokens": 500, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=a.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x).startswith("data: {")
            engine.stop()  # returns with both servers stopped and their threads gone
            assert not a.running and not b.running
            assert _threads_of(a.port) == [] and _threads_of(b.port) == []
            rest = [x for x in lines if x]
    assert any('"code":"request_cancelled"' in x for x in rest) and rest[-1] == "data: [DONE]", rest
    assert servers_for(engine) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(a.url.removesuffix("/v1") + "/health", timeout=5)


def test_a_served_engine_lives_while_its_server_runs():
    engine = make_engine()
    server = engine.serve(port=0)
    ref, loop = weakref.ref(engine), _loop_thread(engine)
    del engine
    gc.collect()
    assert ref() is server.engine is not None  # no name refers to it, the running server does
    assert _complete(server.url)["usage"]["completion_tokens"] == 3  # and it still serves
    server.stop()
    gc.collect()
    assert ref() is None and server.engine is None  # a stopped server, still referenced, lets its engine go
    loop.join(TIMEOUT)
    assert not loop.is_alive()
    assert server.counters()["requests_total"] == 1 and not server.running  # its last figures stay readable


def test_a_stopped_server_does_not_start_again():
    engine = make_engine()
    server = engine.serve(port=0)
    server.stop()
    del engine
    gc.collect()
    with pytest.raises(RuntimeError, match="does not start again"):
        server.start()


EXIT_SCRIPT = """
import atexit, sys, threading, time

def report():  # registered first, so it runs last: after every cbnb exit handler, before the threads are frozen
    left = [t for t in threading.enumerate() if t.name.startswith("cbnb")]
    for t in left:
        if t.name.startswith("cbnb-server-tokenize"):  # told to end (an idle pool worker): a moment to do so
            t.join(5)
    print("LEFT", sorted(t.name for t in left if t.is_alive()), flush=True)

atexit.register(report)
sys.path.insert(0, {tests!r})
import httpx, torch
torch.set_num_threads(1)
from helpers_server import make_engine, slow_steps

engine = make_engine()
slow_steps(engine, 0.02)
server = engine.serve(port=0)
client = httpx.Client(base_url=server.url, timeout=30)
stream = client.stream("POST", "/completions", json={{"prompt": "hi", "max_tokens": 800, "stream": True}})
lines = stream.__enter__().iter_lines()
print("FIRST", next(x for x in lines if x)[:6], flush=True)
# exit with the engine running, the server serving and a stream in flight: nothing stopped by hand
"""


def test_interpreter_exit_stops_servers_and_engines_cleanly():
    code = textwrap.dedent(EXIT_SCRIPT.format(tests=str(REPO / "tests")))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "FIRST data: " in p.stdout
    assert "LEFT []" in p.stdout, p.stdout + p.stderr  # no cbnb thread (engine, server, tokenizer pool) left
    assert "Traceback" not in p.stderr and "Exception" not in p.stderr, p.stderr
