"""The Runs panel's Python side: rows with spread, comparison selection, the chart's data, exports, and following
the run log. No browser (tests/ui/test_runs_ui.py clicks the real panel)."""

from __future__ import annotations

import time

import pytest

from cbnb.core.config import ContinuousBatchingConfig as C
from cbnb.telemetry.runs import RunLog
from cbnb.ui.poller import Frame
from cbnb.ui.runs_panel import RunsPanel, chart_data, group_rows

from fake_engine import FakeEngine
from helpers_ui import WL, make_log

@pytest.fixture
def panel():
    eng = FakeEngine()
    eng.runs = make_log()
    p = RunsPanel(eng, autostart=False)
    yield p
    p.close()


def test_rows_are_groups_with_spread(panel):
    rows = panel.rows
    assert [r["change"] for r in rows] == ["page_size=16", "base", "page_size=64", "base"]
    assert [r["engine"] for r in rows] == ["cbnb", "cbnb", "cbnb", "hf-cb"]
    assert rows[0]["n"] == 3 and rows[0]["ids"] == [1, 4, 7] and rows[3]["n"] == 1
    assert rows[0]["figures"]["goodput_requests_per_s"] == pytest.approx([1.1, 1.0, 1.2])
    assert rows[0]["arrivals"] == "Poisson 1.2/s"
    assert panel.fields == ["page_size"] and panel.log_size == 10


def test_chart_is_median_with_min_max_per_field_value(panel):
    panel.set_chart("goodput_requests_per_s", "page_size")
    c = panel.chart
    cb = next(s for s in c["series"] if s["name"].startswith("cbnb"))
    assert cb["x"] == ["16", "32", "64"]  # the base (32) is a point too, sorted numerically
    assert cb["median"] == pytest.approx([1.1, 1.3, 0.9])
    assert cb["lo"] == pytest.approx([1.0, 1.2, 0.8]) and cb["hi"] == pytest.approx([1.2, 1.4, 1.0])
    assert c["higher_is_better"] and c["label"] == "goodput (req/s)"
    assert any(s["name"].startswith("hf-cb") for s in c["series"])
    panel.chart_figure = "ttft_s_p99"
    assert panel.chart["figure"] == "ttft_s_p99" and not panel.chart["higher_is_better"]


def test_select_two_and_export_the_first(panel):
    a, b = panel.rows[0]["key"], panel.rows[3]["key"]
    panel.select(a, b)
    assert panel.selected == [a, b]
    assert "page_size=16" in panel.export_text and "ContinuousBatchingConfig(" in panel.export_text
    assert panel.export("vllm").startswith("# vllm") and "--block-size 16" in panel.export_text
    assert "--page-size 16" in panel.export("sglang")
    assert "--cb-block-size 16" in panel.export("transformers-serve")
    assert panel.config_of(a).page_size == 16
    with pytest.raises(ValueError, match="export target"):
        panel.export("tgi")
    with pytest.raises(KeyError):
        panel.select("nope")
    # A third pick from the front-end keeps the last two.
    panel.selected = [a, b, panel.rows[1]["key"]]
    assert panel.selected == [b, panel.rows[1]["key"]]


def test_front_end_messages(panel):
    a = panel.rows[2]["key"]
    panel._dispatch(panel, {"kind": "select", "keys": [a]}, [])
    panel._dispatch(panel, {"kind": "export", "target": "vllm"}, [])
    assert panel.export_target == "vllm" and "--block-size 64" in panel.export_text
    assert panel.message_kind == "ok" and "Exported run group 3, 6, 9 to vllm" in panel.message


def test_follows_the_run_log(panel):
    log = panel.log
    before = len(panel.rows)
    log.add("run", config=C(page_size=32, num_blocks=64, safety_margin=0.3), workload=WL,
            metrics={"goodput_requests_per_s": 2.0})
    panel._update(Frame(wall=time.time()))
    assert len(panel.rows) == before + 1 and panel.rows[-1]["change"] == "safety_margin=0.3"
    assert panel.fields == ["page_size", "safety_margin"]


def test_group_rows_and_chart_without_figures():
    log = RunLog(base=C())
    log.add("run", config=C(), workload=WL, metrics={})
    rows = group_rows(log, ["goodput_requests_per_s"])
    assert rows[0]["figures"]["goodput_requests_per_s"] == [None, None, None]
    assert chart_data(rows, "goodput_requests_per_s", "page_size")["series"] == []
