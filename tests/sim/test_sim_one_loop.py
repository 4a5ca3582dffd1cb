"""One loop, two clocks: a `SimEngine` runs the engine loop's own turns (`cbnb.engine.loop`, phases in
`cbnb.engine.phases`), caller-driven, on its playback thread and step by step, sync and async; and a paused
simulation holds the cell that runs it (as `generate()` holds on a paused engine) until Step or Resume."""

from __future__ import annotations

import sys
import threading

import pytest

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.engine_core import EngineCore
from cbnb.lab.traffic import Fixed, Poisson
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import synthetic
from cbnb.sim import SimEngine

from helpers_engine import TIMEOUT
from helpers_server import wait_until

LOOP_MODULES = {"cbnb.engine.loop", "cbnb.engine.phases"}
CFG = dict(page_size=16, num_blocks=128, max_batch_tokens=64)


@pytest.fixture
def callers(monkeypatch):
    """The module of every caller of `EngineCore.schedule` / `EngineCore.apply` while the test runs."""
    seen: dict[str, set[str]] = {"schedule": set(), "apply": set()}
    for name in seen:
        original = getattr(EngineCore, name)

        def wrapped(self, *a, __original=original, __name=name, **kw):
            seen[__name].add(sys._getframe(1).f_globals["__name__"])
            return __original(self, *a, **kw)

        monkeypatch.setattr(EngineCore, name, wrapped)
    return seen


@pytest.mark.parametrize("async_", [False, True])
def test_schedule_and_apply_are_called_only_from_the_engine_loop(callers, async_):
    sim = SimEngine("qwen3-0.6b", "l4", ContinuousBatchingConfig(**CFG), async_batching=async_)
    assert sim.async_batching is async_
    hs = [sim.submit(list(range(10, 40 + 3 * i)), 6, arrival_s=0.002 * i) for i in range(6)]
    sim.run_until(0.004)  # in pieces, then to the end
    sim.run()
    sim.pause()
    more = [sim.submit(list(range(50, 70)), 3) for _ in range(2)]
    while sim.step() is not None:  # single steps
        pass
    sim.resume()
    sim.reconfigure(page_size=32)
    sim.start()  # the playback thread
    try:
        late = sim.submit(list(range(80, 100)), 4)
        assert late.result(TIMEOUT).state.name == "FINISHED"
    finally:
        sim.stop()
    assert all(h.result().state.name == "FINISHED" for h in hs + more)
    assert callers["schedule"] and callers["apply"]
    assert callers["schedule"] | callers["apply"] <= LOOP_MODULES, callers


def test_the_simulator_has_no_turn_code_of_its_own():
    """No module that runs a SimEngine calls the core's turn methods (`schedule`, `apply`, `add`) itself."""
    import ast
    import importlib
    import inspect

    for name in ("engine", "driving", "playback", "executor", "arrivals", "build"):
        tree = ast.parse(inspect.getsource(importlib.import_module(f"cbnb.sim.{name}")))
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert not calls & {"schedule", "apply", "fail_batch"}, name


N_CELL = 600  # enough that the cell is still running when the other thread presses Pause (it runs on after Resume)


def _workload(n: int = N_CELL):
    return synthetic("steps", n, Poisson(200.0), Fixed(40), Fixed(8), vocab_size=1000, seed=3)


@pytest.mark.parametrize("async_", [False, True])
def test_a_paused_simulation_holds_its_cell_steps_and_resumes(async_):
    """A thread presses Pause, Step and Resume (the dashboard) while another runs `run_workload` on a
    caller-driven SimEngine (the cell): the cell holds while paused, each Step plans exactly one step, Resume lets
    it finish; no exception reaches the cell."""
    sim = SimEngine("qwen3-0.6b", "l4", ContinuousBatchingConfig(**CFG), async_batching=async_)
    out: dict = {}

    def cell():
        try:
            out["run"] = run_workload(sim, _workload(), timeout=600)
        except BaseException as e:  # surfaced below
            out["error"] = e

    t = threading.Thread(target=cell)
    t.start()
    planned = lambda: sim.events.events("step_planned")  # noqa: E731
    wait_until(lambda: len(planned()) >= 3 or not t.is_alive(), what="some steps")
    assert sim.pause(timeout=TIMEOUT) and t.is_alive()
    n = len(planned())
    for _ in range(3):
        sid = sim.step(timeout=TIMEOUT)
        assert t.is_alive() and sim.paused
        assert len(planned()) == n + 1 and planned()[-1].step == sid
        n += 1
    assert sim._loop.parked.wait(TIMEOUT)
    assert len(planned()) == n and t.is_alive()  # held: no step without a Step
    sim.resume()
    t.join(TIMEOUT)
    assert not t.is_alive() and "error" not in out, out.get("error")
    assert [r.state for r in out["run"].records] == ["FINISHED"] * N_CELL


def test_run_holds_while_paused_and_a_timeout_bounds_a_paused_wait():
    sim = SimEngine("qwen3-0.6b", "l4", ContinuousBatchingConfig(**CFG))
    hs = [sim.submit(list(range(10, 50)), 5) for _ in range(3)]
    sim.pause()
    with pytest.raises(TimeoutError):
        hs[0].result(timeout=0.1)
    done = threading.Event()
    t = threading.Thread(target=lambda: (sim.run(), done.set()))
    t.start()
    assert sim.step(timeout=TIMEOUT) is not None and not done.is_set()
    sim.resume()
    assert done.wait(TIMEOUT)
    t.join(TIMEOUT)
    assert [h.result().state.name for h in hs] == ["FINISHED"] * 3
