"""Stop means stop (issue 40, item 2): an interrupt (a notebook's stop button: KeyboardInterrupt in the thread that
runs the cell) or a `timeout=` during `run_workload`, `sweep`, `measure_capacity` or a load sweep cancels everything
that call submitted, on the real engine and on the simulator, and says so in one line.

The interrupt is delivered as the stop button delivers it: SIGINT to the main thread (the test's), from a timer
thread that waits until the call has requests in the engine."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

import cbnb
from cbnb import ContinuousBatchingConfig
from cbnb.lab import traffic as tr
from cbnb.lab.load_sweep import load_sweep
from cbnb.lab.tuning import measure_capacity, run_workload, sweep
from cbnb.lab.workloads import synthetic
from cbnb.sim import SimEngine

from helpers_engine import TIMEOUT, tiny_model

LIVE = ("PENDING", "PREFILLING", "DECODING")


pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_gc_callbacks")  # one torch thread (tests/conftest.py)


@pytest.fixture
def no_gc_callbacks():
    """No `gc.callbacks` while a test interrupts itself: Python swallows an exception raised inside a gc callback
    ("Exception ignored in ..."), and hypothesis, imported by other tests, installs one that times every collection,
    so a SIGINT whose handler ran inside it was lost (CI, 2026-12-07: "DID NOT RAISE KeyboardInterrupt" with that
    KeyboardInterrupt reported as unraisable in hypothesis's gc_callback)."""
    saved = gc.callbacks[:]
    gc.callbacks.clear()
    try:
        yield
    finally:
        gc.callbacks[:] = saved


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny:llama")


def _workload(n: int = 24, new: int = 40):
    return synthetic("stop", n, tr.Offline(), tr.Uniform(8, 40), tr.Fixed(new), vocab_size=512, seed=1)


def _live(engine) -> list[str]:
    return [o.request_id for o in engine.requests_snapshot() if o.state.name in LIVE]


def _interrupt_when(cond, timeout: float = TIMEOUT) -> threading.Thread:
    """SIGINT to the main thread once `cond()` holds (polled from a timer thread), as the stop button does."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's KeyboardInterrupt here (a background job ignores it)")
    main = threading.main_thread().ident

    def fire():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if cond():
                    break
            except Exception:
                pass
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


def _wait_no_live(engine, timeout: float = TIMEOUT) -> list[str]:
    """The engine's live requests once they are all gone (a cancel takes effect at the next step), or what is left
    after `timeout`."""
    end = time.monotonic() + timeout
    while _live(engine) and time.monotonic() < end:
        time.sleep(0.02)
    return _live(engine)


@pytest.fixture
def engine(model):
    eng = cbnb.Engine(model, config=ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32))
    eng.start()
    yield eng
    eng.stop()


def _running(engine) -> bool:
    return any(o.state.name == "DECODING" for o in engine.requests_snapshot())


@pytest.mark.parametrize("call", ["run_workload", "sweep", "measure_capacity", "load_sweep"])
def test_an_interrupt_cancels_everything_the_call_submitted_on_the_real_engine(engine, call, capsys):
    from cbnb.ui import Dashboard

    dash = Dashboard(engine, start=False)
    wl = _workload()
    t = _interrupt_when(lambda: _running(engine))
    with pytest.raises(KeyboardInterrupt) as exc:
        if call == "run_workload":
            run_workload(engine, wl, timeout=TIMEOUT)
        elif call == "sweep":
            sweep(engine, wl, {"max_batch_tokens": [32, 64]}, repeats=2, progress=False, timeout=TIMEOUT)
        elif call == "measure_capacity":
            measure_capacity(engine, wl, repeats=2, timeout=TIMEOUT)
        else:
            load_sweep(engine, wl, concurrencies=[4, 8], timeout=TIMEOUT)
    t.join()
    assert _wait_no_live(engine) == [], "the engine still runs requests of the interrupted call"
    # one line (the run's, or the helper's when the interrupt landed between runs: a reconfigure, a warm-up)
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("cbnb: ") and " interrupted" in ln]
    assert len(line) == 1 and ("cancelled" in line[0] or "left no request running" in line[0]), line
    assert getattr(exc.value, "__notes__", []) == [line[0]]
    # the dashboard says it at once, on its Controls line
    assert dash.controls.message == line[0].removeprefix("cbnb: ").capitalize(), dash.controls.message
    dash.close()
    # the engine serves the next call
    assert engine.generate([[5, 6, 7]], max_new_tokens=2, ignore_eos=True)[0].state.name == "FINISHED"


def test_a_timeout_cancels_everything_the_call_submitted(engine, capsys):
    # The engine is paused so the run cannot end before its timeout on any machine (a fast one finished the whole
    # workload within 0.5 s); the cancels are applied when it resumes.
    assert engine.pause(timeout=TIMEOUT)
    try:
        with pytest.raises(TimeoutError):
            run_workload(engine, _workload(n=30, new=60), timeout=0.5)
    finally:
        engine.resume()
    assert _wait_no_live(engine) == []
    assert "cbnb: run timed out: cancelled" in capsys.readouterr().err


def _sim() -> SimEngine:
    return SimEngine("smollm2-135m", "h100-sxm", ContinuousBatchingConfig(page_size=16, num_blocks=4096,
                                                                          max_batch_tokens=256))


@pytest.mark.parametrize("call", ["run_workload", "sweep"])
def test_an_interrupt_cancels_everything_the_call_submitted_on_the_simulator(call, capsys):
    """The simulator runs in the caller's thread (virtual clock): the interrupt lands inside the simulation."""
    sim = _sim()
    wl = synthetic("stop", 4000, tr.Poisson(2000.0), tr.Uniform(64, 512), tr.Fixed(256), vocab_size=512, seed=2)
    t = _interrupt_when(lambda: sim.present > 0.05)
    with pytest.raises(KeyboardInterrupt):
        if call == "run_workload":
            run_workload(sim, wl, timeout=TIMEOUT)
        else:
            sweep(sim, wl, {"max_batch_tokens": [256, 512]}, repeats=1, progress=False, timeout=TIMEOUT)
    t.join()
    assert _live(sim) == [], "the simulator still holds requests of the interrupted call"
    err = capsys.readouterr().err
    assert "cbnb: run interrupted: cancelled" in err or "cbnb: sweep interrupted between its runs" in err, err


def test_ipython_shows_a_stopped_cell_as_one_line_not_a_traceback(tmp_path):
    """Found in the teacher's trial (issue 40): the stop button's one-line message sat above a ~40-line
    KeyboardInterrupt traceback through the engine's internals. A stop cbnb announced renders as one line in IPython
    (in a subprocess: an InteractiveShell is process-wide); any other interrupt keeps its traceback."""
    import subprocess
    import sys

    script = tmp_path / "cell.py"
    script.write_text(
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "sh = InteractiveShell.instance()\n"
        "sh.run_cell('from cbnb.lab.driver import announce_stop\\n'\n"
        "            'def deep(n):\\n    if n == 0:\\n        raise KeyboardInterrupt\\n    deep(n - 1)\\n'\n"
        "            'try:\\n    deep(30)\\n'\n"
        "            'except KeyboardInterrupt as e:\\n'\n"
        "            '    announce_stop(None, e, \"cbnb: run interrupted: cancelled 3 unfinished requests\")\\n'\n"
        "            '    raise\\n')\n"
        "print('=== other')\n"
        "sh.run_cell('def deep(n):\\n    if n == 0:\\n        raise KeyboardInterrupt\\n    deep(n - 1)\\ndeep(3)')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT)
    import re

    ours, other = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).split("=== other")  # IPython's colours
    assert "cbnb: run interrupted: cancelled 3 unfinished requests" in out.stderr
    assert "KeyboardInterrupt: the cell was stopped (cbnb's line above says what it cancelled)" in ours
    assert "deep(n - 1)" not in ours and len(ours.strip().splitlines()) <= 2, ours
    assert "deep(n - 1)" in other  # an interrupt cbnb did not handle keeps IPython's traceback


def test_outside_ipython_a_stopped_calls_exception_still_pickles():
    """The one-line rendering is IPython's only (a method on the exception, which pickle cannot carry): outside it
    the exception of a stopped call pickles, as a process pool's worker must send it back."""
    import pickle

    from cbnb.lab.driver import announce_stop

    e = TimeoutError("the run did not end")
    announce_stop(None, e, "cbnb: run timed out: cancelled 2 unfinished requests")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == "the run did not end" and not hasattr(e, "_render_traceback_")
