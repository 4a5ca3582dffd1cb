"""The example notebooks: committed without outputs, and each runs headless (nbclient) at its class size (what a
workshop runs: `cbnb.lab.classroom`; 05 at its real size, a simulation), except those a browser test runs whole
(`helpers_notebooks.IN_BROWSER`, where the browser tests can run): one full execution of each notebook per suite.
CBNB_CI=1 only frees the fixed port of notebook 06; CBNB_SIZE is removed so that a developer's "full" never leaks
into the suite."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from helpers_notebooks import EXPECT, IN_BROWSER, missing

from ui.lab import skip_reason

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
HEADLESS = [n for n in NOTEBOOKS if n not in IN_BROWSER or skip_reason()]


def test_the_notebooks_exist():
    assert NOTEBOOKS == ["01_quickstart.ipynb", "02_tuning_page_size_and_safety_margin.ipynb",
                         "03_prefix_caching.ipynb", "04_offloading_and_soft_reset.ipynb", "05_what_if_production.ipynb",
                         "06_serve_and_load.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_measures_the_machine_and_has_one_size_variable(name):
    """Class mode: the first code cell measures the machine and picks the size (one variable away from "full"), the
    long cells say how long they take here, and no size depends on CBNB_CI (CI runs what a class runs)."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "SIZE = size()" in code[0] and "measure()" in code[0], f"{name}: the first cell sets SIZE and measures"
    assert any("here.estimate(" in c for c in code), f"{name}: no cell says how long it takes here"
    for c in code:
        for line in c.splitlines():
            assert "CBNB_CI" not in line or "PORT" in line, f"{name}: a size depends on CBNB_CI: {line}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: a code cell has outputs"
    assert "widgets" not in nb.metadata, f"{name}: saved widget state (5 MB per figure) must not be committed"


def _texts(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            for mime in ("text/markdown", "text/plain", "text/html"):
                if mime in out.get("data", {}):
                    parts.append(str(out["data"][mime]))
    return "\n".join(parts)


@pytest.mark.slow
def test_every_notebook_has_its_expectations():
    assert sorted(EXPECT) == NOTEBOOKS and set(IN_BROWSER) <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", HEADLESS)
def test_notebook_runs_headless(name, monkeypatch, tmp_path):
    from nbclient import NotebookClient

    monkeypatch.setenv("CBNB_CI", "1")
    monkeypatch.delenv("CBNB_SIZE", raising=False)  # the class size, as a class runs it
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # One torch thread in the kernel: on a machine shared with other jobs two threads collapse (cbnb.lab.workloads'
    # calibration notes: 0.12-0.17 vs 0.9-1.4 requests/s), and notebook 02's timed traffic is paced by the capacity
    # it measures, so its duration would grow with the contention.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()  # raises on any cell error
    assert missing(name, _texts(nb)) == [], f"{name}: expected in the outputs"
