"""The Runs panel in a real JupyterLab, driven through headless Debian Chromium.

A small notebook (written here) runs an interleaved sweep with repeats on a tiny random model, plus the same traffic
through transformers' continuous batching, then shows the dashboard. The tests tick two rows and check Python's
selection, compare them, change the chart's figure and field, export a run's config, and take screenshots in the
light and dark themes (test-artifacts/ui/runs-*.png).
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import nbformat
import pytest

from .lab import ARTIFACTS, TOKEN, Lab, settle, skip_reason, switch_theme, wait_run_all_done

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    "import cbnb\n"
    "from cbnb.lab import traffic as tr\n"
    "from cbnb.bench.engine_peer import HFContinuousBatching\n"
    "from cbnb.lab.tuning import run_workload, sweep\n"
    "from cbnb.ui import Dashboard\n"
    "from cbnb.lab.workloads import synthetic\n"
    "model, _ = cbnb.load_model('tiny:llama')\n"
    "base = cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64)\n"
    "engine = cbnb.Engine(model, None, base).start()\n"
    "wl = synthetic('tiny-poisson', 6, tr.Poisson(30.0), tr.Uniform(4, 24), tr.Uniform(2, 6), vocab_size=512)",
    "res = sweep(engine, wl, {'page_size': [16, 32], 'safety_margin': [0.0, 0.2]}, repeats=2, progress=False,\n"
    "            derive=lambda c: {'num_blocks': 1024 // c['page_size']})\n"
    "engine.reconfigure(base)\n"
    "with HFContinuousBatching(model, base, max_new_tokens=8, share_with=engine) as hf:\n"
    "    ab = run_workload(hf, wl, log=engine.runs, label='transformers')\n"
    "print(len(engine.runs), 'log entries')",
    "dash = Dashboard(engine)\ndash",
]


@pytest.fixture(scope="module")
def session(tmp_path_factory, chromium):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb_path = tmp_path_factory.mktemp("runsnb") / "runs_panel.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nb_path)
    lab = Lab([nb_path], env={"CBNB_CI": "1", "OMP_NUM_THREADS": "1"}).start()
    errors: list[str] = []
    try:
        page = chromium.new_page(viewport={"width": 1440, "height": 900})
        try:
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab.url}/lab/tree/{nb_path.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_function("""() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;
                return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
                       && w.sessionContext.kernelDisplayStatus === 'idle'; }""", timeout=90_000)
            page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            page.wait_for_selector(".cbnb-runs .cbnb-runs-table tbody tr", timeout=240_000)
            wait_run_all_done(page)
            page.locator(".cbnb-runs").scroll_into_view_if_needed()
            yield lab, page, errors
        finally:
            page.close()
    finally:
        lab.stop()


def _py(lab, expr: str) -> str:
    return lab.kernel_eval({"v": expr})["v"]


def _runs_shot(page, name: str, part: str = ".cbnb-runs-table") -> None:
    """A 1440x900 screenshot with `part` of the panel scrolled to the top of the notebook view."""
    page.evaluate("(sel) => document.querySelector(sel).scrollIntoView({block: 'start'})", part)
    settle(page)
    page.screenshot(path=str(ARTIFACTS / name))


def test_table_shows_groups_with_spread(session):
    lab, page, errors = session
    rows = page.locator(".cbnb-runs-table tbody tr")
    assert rows.count() == 5  # 4 sweep points (2 repeats each) + transformers' run
    text = rows.first.locator(".cbnb-fig-goodput_requests_per_s").text_content()
    assert re.search(r"[\d.]+ \[[\d.]+–[\d.]+\]", text), text  # median [min–max] over 2 repeats
    assert "hf-cb" in page.locator(".cbnb-runs-table").text_content()
    assert int(_py(lab, "len(dash.runs.rows)")) == 5
    assert errors == [], errors


def test_tick_two_rows_compares_them_and_python_sees_it(session):
    lab, page, errors = session
    rows = page.locator(".cbnb-runs-table tbody tr")
    rows.nth(0).locator("input.cbnb-runs-check").check()
    rows.nth(4).locator("input.cbnb-runs-check").check()
    keys = [rows.nth(i).get_attribute("data-key") for i in (0, 4)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ast.literal_eval(_py(lab, "list(dash.runs.selected)")) != keys:
        time.sleep(0.2)
    assert ast.literal_eval(_py(lab, "list(dash.runs.selected)")) == keys
    page.wait_for_selector(".cbnb-runs-compare-table tr[data-figure=goodput_requests_per_s]", timeout=15_000)
    head = page.locator(".cbnb-runs-compare-table th.cbnb-runs-b").text_content()
    assert head.startswith("B: hf-cb")
    assert "config differs in" in page.locator(".cbnb-runs-config-diff").text_content()
    _runs_shot(page, "runs-compare-light.png")
    assert errors == [], errors


def test_chart_follows_figure_and_field(session):
    lab, page, errors = session
    page.locator("select.cbnb-runs-figure").select_option("ttft_s_p99")
    page.locator("select.cbnb-runs-field").select_option("safety_margin")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _py(lab, "dash.runs.chart['field']") != "'safety_margin'":
        time.sleep(0.2)
    assert _py(lab, "(dash.runs.chart['figure'], dash.runs.chart['field'])") == "('ttft_s_p99', 'safety_margin')"
    xs_py = sorted({x for s in ast.literal_eval(_py(lab, "dash.runs.chart['series']")) for x in s["x"]})
    assert {"0.0", "0.2"} <= set(xs_py)  # the sweep's margins (transformers' run kept the base's None)
    page.wait_for_function("""(want) => Array.from(document.querySelectorAll('.cbnb-runs-xtick'))
        .map(e => e.textContent).sort().join(',') === want""", arg=",".join(xs_py), timeout=15_000)
    n_py = int(_py(lab, "sum(len(s['x']) for s in dash.runs.chart['series'])"))
    assert page.locator(".cbnb-runs-chart circle.cbnb-runs-point").count() == n_py
    assert page.locator(".cbnb-runs-chart line.cbnb-runs-bar").count() == n_py
    assert "lower is better" in page.locator(".cbnb-runs-legend").text_content()
    assert errors == [], errors


def test_export_chosen_run_config(session):
    lab, page, errors = session
    page.locator("select.cbnb-runs-target").select_option("vllm")
    page.locator(".cbnb-runs-export-btn").click()
    page.wait_for_function("() => /Exported run group/.test(document.querySelector('.cbnb-runs > .cbnb-message')"
                           ".textContent)", timeout=30_000)
    shown = page.locator(".cbnb-runs-export-text").text_content()
    assert shown == ast.literal_eval(_py(lab, "dash.runs.export_text"))
    assert "--block-size 16" in shown
    assert re.search(r"Exported run group [\d, ]+ to vllm", page.locator(".cbnb-runs > .cbnb-message").text_content())
    _runs_shot(page, "runs-export-light.png", ".cbnb-runs-lower")
    switch_theme(page, "JupyterLab Dark")
    _runs_shot(page, "runs-export-dark.png", ".cbnb-runs-lower")
    _runs_shot(page, "runs-table-dark.png")
    # The dark theme reaches the panel: its background follows JupyterLab's variables.
    bg = page.evaluate("() => getComputedStyle(document.querySelector('.cbnb-runs')).backgroundColor")
    assert bg not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), bg
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
    assert errors == [], errors
