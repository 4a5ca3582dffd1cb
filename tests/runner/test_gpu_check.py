"""The device check script (`scripts/gpu_check.py`) on CPU: the block tables of every GPU kernel case, the plan and
its time caps, a part that overruns its cap, the bf16 divergence metric, and the whole ``--cpu-smoke`` run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run under Triton's interpreter (set before its import)

import gpu_check  # noqa: E402
import gpu_check_kernels as gk  # noqa: E402


def test_every_gpu_kernel_case_builds_its_inputs():
    # The GPU cases exactly as the device runs them (same RNG stream), on CPU and without the cache: a block table
    # that does not fit the cache raised here before the device run lost every kernel result to it.
    rng = random.Random(0)
    blocks = []
    for case in gk.GPU_CASES:
        inp = gk.case_inputs(case, rng, "cpu", with_cache=False)
        R, W = inp["dec_table"].shape
        assert R == case.requests and inp["pre_table"].shape[0] == gk.PREFILL_SEQS
        for table in (inp["dec_table"], inp["pre_table"]):
            assert int(table.min()) >= 1 and int(table.max()) < inp["nb"]  # block 0 is the read padding
        assert len(set(inp["dec_table"][:, 1:].flatten().tolist())) == R * (W - 1)  # distinct, but the shared one
        blocks.append(inp["nb"])
    assert max(blocks) > 600  # what the old fixed cache of 600 blocks could not hold


def test_kernel_cases_run_each_guarded(monkeypatch):
    # One failing case is a record; the others still run and report.
    calls = []
    real = gk.check_case

    def flaky(ta, case, inp, device):
        calls.append(case)
        if len(calls) == 1:
            raise RuntimeError("illegal memory access")
        return real(ta, case, inp, device)

    monkeypatch.setattr(gk, "check_case", flaky)
    res = gk.run(True, "cpu", 132, lambda *a: None, lambda r: None)
    assert len(calls) == len(gk.SMOKE_CASES)
    assert res["checks"][0]["ok"] is False and "illegal memory access" in res["checks"][0]["error"]
    assert all(c["ok"] for c in res["checks"][1:]) and len(res["checks"]) == 1 + 2 * (len(gk.SMOKE_CASES) - 1)
    assert len(res["gpu_case_inputs"]) == len(gk.GPU_CASES) and res["all_ok"] is False


def test_plan_puts_the_headline_first_and_fits_the_deadline():
    rows = gpu_check.plan(540, {u[0] for u in gpu_check.UNITS})
    assert [r[0] for r in rows][:3] == ["probe", "headline_cbnb", "headline_hf"]
    assert rows[0][1] <= 30
    assert rows[-1][3] <= 540 and sum(r[1] for r in rows) <= 540
    short = gpu_check.plan(100, {u[0] for u in gpu_check.UNITS})
    assert sum(r[1] for r in short) <= 100 and short[-1][1] == 0  # later parts get nothing, not more


def test_a_part_past_its_cap_is_stopped_and_keeps_what_it_published(tmp_path):
    (tmp_path / "parts").mkdir()
    part = tmp_path / "parts" / "slow.json"
    child = ("import json, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"json.dump({{'figure': 42}}, open({str(part)!r}, 'w')); time.sleep(120)")
    t0 = time.time()
    entry = gpu_check.supervise("slow", [sys.executable, "-c", child], 1.5, str(tmp_path))
    took = time.time() - t0
    assert entry["timed_out"] and not entry["ok"] and entry["figure"] == 42
    assert took < 1.5 + 2 * gpu_check.GRACE_S + 5  # SIGTERM ignored: SIGKILL after the grace
    assert entry["rc"] == -9


def test_bf16_divergence_is_a_distribution():
    import gpu_check_units as gu

    pairs = [([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 9, 4], [1, 2, 3, 4]), ([7, 2, 3, 4], [1, 2, 3, 4]),
             ([1, 2, 3, 5], [1, 2, 3, 4])]
    d = gu.divergence_stats(pairs, 4)
    assert d["identical_share"] == 0.25
    assert d["first_divergence"]["min"] == 0 and d["first_divergence"]["max"] == 4
    assert d["histogram"] == {"0": 1, "2": 1, "3": 1, "4": 1}


def test_cpu_smoke_runs_every_part(tmp_path):
    # `scripts/gpu_check.sh --cpu-smoke`, as CI runs it: every part's code path on CPU, each part ok.
    env = dict(os.environ, OUT=str(tmp_path), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = [u[0] for u in gpu_check.UNITS]
    assert res["summary"]["parts"] == {p: "ok" for p in parts}, res["summary"]["parts"]
    assert "plan: 8 parts" in proc.stdout
    sec = res["sections"]
    assert sec["probe"]["triton_launch"]["ok"] and sec["probe"]["build_tools"]["python_h"] in (True, False)
    head = sec["headline_cbnb"]["runs"]
    assert head["full"]["output_tokens"] > 0 and head["full"]["graph_counts"][0] > 0
    assert head["full"]["memory_split"]["cuda_graphs"] == 0  # a CPU engine sizes no graph memory
    sbs = res["side_by_side"]
    assert sbs["cbnb_tok_per_s"] > 0 and sbs["hf_cb_tok_per_s"] > 0 and sbs["greedy_identical_share"] == 1.0
    assert sec["sync_debug"]["finished"] == sec["sync_debug"]["requests"] > sec["sync_debug"]["sampled"] > 0
    assert len(sec["kernels"]["gpu_case_inputs"]) == len(gk.GPU_CASES) and sec["kernels"]["all_ok"]
    assert sec["fp32_tiny"]["all_identical"]
    assert "first_divergence" in sec["bf16_agreement"]["models"]["tiny:llama"]
    assert set(sec["variants"]["variants"]) == {"graphs_on_async_off", "graphs_off_async_off", "graphs_off_async_on"}
    assert sec["variants"]["variants"]["graphs_off_async_off"]["graph_counts"][0] == 0  # graphs off really off
    assert (tmp_path / "gpu_check.log").read_text().count("== ") == len(parts)
