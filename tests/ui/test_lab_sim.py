"""`Dashboard(SimEngine)` in a real JupyterLab, driven through headless Debian Chromium.

A notebook builds a simulated llama-3.1-8b on an H100 profile with 300 Poisson arrivals, opens the unchanged
`cbnb.ui.Dashboard` on it and starts the simulation at 1.5x simulated time. The test checks that the panels animate
(the board's finished rows, the plots' steps, the KV page map and the simulated clock all move between two looks),
that the page map shows the simulated cache, that the Submit panel's workload button submits to the simulator and
those requests finish, that Pause / Step / Resume step the simulation one simulated step per click, and takes 1440x900 screenshots in the light and dark themes while it runs
(test-artifacts/ui/sim-{top,plots}-{light,dark}.png).
"""

from __future__ import annotations

import ast
import json
import time

import pytest

from .lab import ARTIFACTS, Lab, open_notebook, run_all, settle, skip_reason, switch_theme, wait_run_all_done

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    "import os\nos.setpriority(os.PRIO_PROCESS, 0, 10)  # Chromium shares the cores: let it draw first",
    "from cbnb.sim import SimEngine\nfrom cbnb.measure.scale import poisson_requests\nfrom cbnb.ui import Dashboard\n\n"
    "sim = SimEngine('llama-3.1-8b', 'h100-sxm')\n"
    "for i, (t, ids, n) in enumerate(poisson_requests(300, 10.0, vocab=sim.vocab_size)):\n"
    "    sim.submit(ids, n, request_id=f'p{i}', arrival_s=t)\nsim",
    "dash = Dashboard(sim)\ndash",
    "sim.start(speed=1.5)  # 1.5 simulated seconds per wall second",
]


def _notebook(path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def _look(page, py) -> dict:
    """What the page shows now, and the simulated clock."""
    seen = page.evaluate("""() => {
        const g = document.querySelector('.cbnb-plots .js-plotly-plot');
        return {finished: document.querySelectorAll('.cbnb-board tr[data-state=FINISHED]').length,
                board: document.querySelector('.cbnb-board-summary').textContent,
                plot_steps: g && g.data ? g.data[0].x.length : 0,
                plot_last_step: g && g.data && g.data[0].x.length ? g.data[0].x[g.data[0].x.length - 1] : 0,
                kv: document.querySelector('.cbnb-kv-group-title').textContent};
    }""")
    seen["now"] = float(py("sim.now"))
    return seen


def _shots(page, theme: str) -> None:
    """1440x900 screenshots of the dashboard's top (submit, stream, board) and of its plots and page map."""
    for name, sel in (("top", ".cbnb-dashboard"), ("plots", ".cbnb-plots")):
        page.evaluate(f"() => document.querySelector('{sel}').scrollIntoView({{block: 'start'}})")
        settle(page)  # charts that came on screen draw
        page.screenshot(path=str(ARTIFACTS / f"sim-{name}-{theme}.png"))


def _paused_step(page) -> int:
    status = page.locator(".cbnb-controls .cbnb-controls-status").text_content()
    assert "paused after step " in status, status
    return int(status.split("paused after step ")[1].split()[0])


def _step_mode(page, py) -> None:
    """Pause holds the simulated clock; each Step click runs exactly one simulated step; Resume lets it run on."""
    page.locator(".cbnb-controls").first.scroll_into_view_if_needed()
    page.locator(".cbnb-controls .cbnb-pause").click()
    page.wait_for_selector('.cbnb-controls[data-paused="true"]', timeout=60_000)
    assert py("sim.paused") == "True"
    # The step in flight at the click finishes after it: wait until the status shows the step the engine holds at.
    deadline = time.monotonic() + 60
    while (step := _paused_step(page)) != int(py("sim.core.step_id")):
        assert time.monotonic() < deadline, ("the status never caught up with the paused step", step)
        time.sleep(0.25)
    held = py("(sim.now, sim.core.step_id)")
    page.wait_for_timeout(500)  # wall time passes, the simulated clock and the step count stay
    assert py("(sim.now, sim.core.step_id)") == held
    for _ in range(3):
        page.locator(".cbnb-controls .cbnb-step").click()
        page.wait_for_function("""(n) => {
            const m = /paused after step (\\d+)/.exec(
                document.querySelector('.cbnb-controls .cbnb-controls-status').textContent);
            return m && Number(m[1]) === n;
        }""", arg=step + 1, timeout=60_000)
        step += 1
        assert int(py("sim.core.step_id")) == step
    page.locator(".cbnb-controls .cbnb-controls-status").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "sim-paused-light.png"))
    page.locator(".cbnb-controls .cbnb-resume").click()
    page.wait_for_selector('.cbnb-controls[data-paused="false"]', timeout=60_000)
    deadline = time.monotonic() + 60
    while int(py("sim.core.step_id")) <= step:  # it runs on by itself
        assert time.monotonic() < deadline, "the simulation did not run on after Resume"
        time.sleep(0.25)


def test_dashboard_on_a_simulation_animates_and_submits(tmp_path, chromium):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb = tmp_path / "sim_dashboard.ipynb"
    _notebook(nb)
    lab = Lab([nb], env={"CBNB_CI": "1", "OMP_NUM_THREADS": "1"}).start()
    errors: list[str] = []
    try:
        page = chromium.new_page(viewport={"width": 1440, "height": 900})
        try:
            page.on("pageerror", lambda e: errors.append(str(e)))

            def py(expr: str) -> str:
                return lab.kernel_eval({"v": expr})["v"]

            open_notebook(page, lab, nb.name)
            run_all(page)
            page.wait_for_selector(".cbnb-board table", timeout=120_000)
            page.locator(".cbnb-plots").scroll_into_view_if_needed()  # charts draw only when on screen
            page.wait_for_selector(".cbnb-plots .js-plotly-plot", timeout=120_000)
            wait_run_all_done(page)
            for sel in (".cbnb-submit .cbnb-workload-btn", ".cbnb-stream", ".cbnb-kvmap canvas",
                        ".cbnb-config input[type=range]"):
                assert page.locator(sel).count() >= 1, f"{sel} not rendered"
            assert py("sim.state") == "'running'"

            # The panels animate: two looks 3 s apart differ in every panel, and the clock moved.
            page.wait_for_function(
                "() => document.querySelectorAll('.cbnb-board tr[data-state=FINISHED]').length > 0",
                timeout=60_000)
            page.locator(".cbnb-plots").scroll_into_view_if_needed()
            first = _look(page, py)
            # Waits on the change itself (a loaded machine makes it slower, not red).
            deadline = time.monotonic() + 90
            while True:
                second = _look(page, py)
                if (second["now"] > first["now"] and second["plot_last_step"] > first["plot_last_step"]
                        and second["board"] != first["board"]):
                    break
                assert time.monotonic() < deadline, ("the panels did not animate", first, second)
                time.sleep(0.25)
            # The page map (snapshots are taken while it is on screen) shows the simulated cache, filling.
            page.locator(".cbnb-kvmap").scroll_into_view_if_needed()
            blocks = int(py("sim.config.num_blocks"))
            page.wait_for_function(f"""() => {{ const t = document.querySelector('.cbnb-kv-group-title').textContent;
                return t.includes('{blocks:,} blocks + 2 reserved padding') && !/ 0 tokens filled/.test(t); }}""",
                                   timeout=30_000)
            kv1 = page.locator(".cbnb-kv-group-title").first.text_content()
            page.wait_for_function(f"() => document.querySelector('.cbnb-kv-group-title').textContent !== {kv1!r}",
                                   timeout=30_000)
            _shots(page, "light")
            _step_mode(page, py)
            # Dark theme (JupyterLab's own command), while the simulation still runs.
            switch_theme(page, "JupyterLab Dark")  # and the panels redrew in it
            _shots(page, "dark")
            assert py("sim.state") == "'running'"

            # The Submit panel's workload button submits to the simulator; those requests finish there.
            page.locator(".cbnb-submit .cbnb-workload-btn").click()
            page.wait_for_function("""() => /Submitted workload/.test(
                document.querySelector('.cbnb-submit > .cbnb-message').textContent)""", timeout=30_000)
            ids = ast.literal_eval(py("list(dash.submit.last_ids)"))
            assert ids and all(i.startswith("sim-") for i in ids), ids
            # They show on the board (live, or among the newest ended) ...
            page.wait_for_selector(f".cbnb-board tr[data-id='{ids[-1]}']", state="attached", timeout=30_000)
            py("setattr(sim, 'speed', None)")  # the rest of the traffic as fast as possible: what ends is checked
            assert py("sim.wait_idle(120)") == "True"
            states = py(f"sorted({{o.state.name for o in sim.outputs() if o.request_id in {ids!r}}})")
            assert states == "['FINISHED']", states  # ... and finish in the simulation
            finished = py("sum(o.state.name == 'FINISHED' for o in sim.outputs())")
            assert int(finished) == 300 + len(ids)
            assert py("dash.poller.errors") == "[]"
            assert errors == [], errors
            (ARTIFACTS / "sim_dashboard.json").write_text(json.dumps({"first": first, "second": second}))
            py("sim.stop() or dash.close()")
        finally:
            page.close()
    finally:
        lab.stop()
