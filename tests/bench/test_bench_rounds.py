"""The bench's arithmetic and ordering (never its speed): rotated rounds, medians, per-round ratios, roofline.

Fake peers with fixed seconds check the statistics exactly; a tiny model checks the roofline's FLOP and byte counts
against hand-written formulas and runs the whole command end to end (two rounds, every peer, JSON kept).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

import pytest

from cbnb import bench
from cbnb.bench import roofline
from cbnb.bench.rounds import Entry, rotation, run_rounds, spread, summarize
from cbnb.measure import rates

from helpers_engine import tiny_model


@dataclass
class Fake:
    seconds: float
    output_tokens: int = 100
    tokens: list = field(default_factory=lambda: [[1, 2], [3]])
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


# ----------------------------------------------------------------------------------------------- rounds
def test_rotation_puts_every_entry_in_every_position():
    assert rotation(3, 0) == [0, 1, 2]
    assert rotation(3, 1) == [1, 2, 0]
    assert rotation(3, 2) == [2, 0, 1]
    assert rotation(3, 3) == [0, 1, 2]
    assert rotation(1, 5) == [0]
    for n in (2, 3, 4):
        orders = [rotation(n, r) for r in range(n)]
        for pos in range(n):
            assert sorted(o[pos] for o in orders) == list(range(n))
        assert all(sorted(o) == list(range(n)) for o in orders)


def test_run_rounds_runs_in_rotated_order_probe_first():
    calls: list[str] = []

    def entry(name):
        return Entry(name, lambda: calls.append(name) or Fake(1.0))

    seen = []
    rounds = run_rounds([entry("a"), entry("b"), entry("c")], 4, probe=lambda: calls.append("probe") or {"k": 1},
                        between=lambda: calls.append("|"), on_round=lambda r: seen.append(r.index))
    assert calls == ["probe", "|", "a", "|", "b", "|", "c",
                     "probe", "|", "b", "|", "c", "|", "a",
                     "probe", "|", "c", "|", "a", "|", "b",
                     "probe", "|", "a", "|", "b", "|", "c"]
    assert [r.order for r in rounds] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert seen == [0, 1, 2, 3] and all(r.machine == {"k": 1} for r in rounds)
    assert set(rounds[1].results) == {"a", "b", "c"}


@pytest.mark.parametrize("kw, msg", [
    (dict(entries=[], repeat=1), "no entries"),
    (dict(entries=[Entry("a", Fake), Entry("a", Fake)], repeat=1), "unique"),
    (dict(entries=[Entry("a", Fake)], repeat=0), "repeat must be >= 1"),
])
def test_run_rounds_rejects_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        run_rounds(kw["entries"], kw["repeat"])


def test_spread():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([]) == {"median": None, "min": None, "max": None, "n": 0}


def _rounds(table):
    """Rounds from {name: [seconds per round]} with rotation applied (the order does not change the statistics)."""
    names = list(table)
    entries = []
    for n in names:
        it = iter(table[n])
        entries.append(Entry(n, lambda it=it: next(it)))
    return run_rounds(entries, len(table[names[0]]))


def test_summary_medians_and_per_round_ratios():
    # The machine slows down 3x in round 2 for everyone: per-round ratios stay 2.0, the ratio of medians would not.
    table = {
        "x": [Fake(1.0), Fake(3.0), Fake(1.2)],
        "y": [Fake(2.0), Fake(6.0), Fake(2.4)],
    }
    rounds = _rounds(table)
    s = summarize(rounds, ["x", "y"], floor_s=[0.5, 0.5, None])
    assert s["x"]["tok_per_s"] == {"median": 100 / 1.2, "min": 100 / 3.0, "max": 100.0, "n": 3}
    assert s["y"]["first_over_this"]["median"] == pytest.approx(2.0)
    assert s["y"]["first_over_this"]["min"] == pytest.approx(2.0)
    assert s["x"]["first_over_this"]["median"] == 1.0
    # roofline share = floor / seconds in the rounds that have a floor
    assert s["x"]["roofline_share"] == spread([0.5 / 1.0, 0.5 / 3.0])
    assert s["y"]["roofline_share"] == spread([0.25, 0.5 / 6.0])
    assert s["y"]["greedy_agreement_min"] == 1.0


def test_summary_ratio_is_median_of_round_ratios_not_ratio_of_medians():
    table = {"x": [Fake(1.0), Fake(1.0), Fake(4.0)], "y": [Fake(1.0), Fake(3.0), Fake(4.0)]}
    s = summarize(_rounds(table), ["x", "y"])
    ratios = [1.0, 3.0, 1.0]  # x tok/s / y tok/s per round
    assert s["y"]["first_over_this"]["median"] == pytest.approx(statistics.median(ratios))
    med_ratio = s["x"]["tok_per_s"]["median"] / s["y"]["tok_per_s"]["median"]
    assert med_ratio == pytest.approx(3.0)  # (100 / 1) / (100 / 3): differs from the median of the ratios


def test_summary_leaves_failed_rounds_out_and_counts_disagreement():
    table = {
        "x": [Fake(1.0), Fake(1.0), Fake(1.0)],
        "y": [Fake(2.0), Fake(0.0, 0, [], error="boom"), Fake(4.0, tokens=[[1, 2], [4]])],
    }
    s = summarize(_rounds(table), ["x", "y"])
    assert s["y"]["tok_per_s"]["n"] == 2 and s["y"]["errors"] == ["boom"]
    assert s["y"]["first_over_this"] == spread([2.0, 4.0])
    assert s["y"]["greedy_agreement_min"] == 0.5


# ----------------------------------------------------------------------------------------------- roofline
def _by_hand_body_params(c) -> int:
    h, i, kv, d = c.hidden_size, c.intermediate_size, c.num_key_value_heads, c.head_dim
    q = c.num_attention_heads * d
    return c.num_hidden_layers * (h * q + 2 * h * kv * d + q * h + 3 * h * i)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_model_cost_matches_the_config(name):
    model = tiny_model(name)
    c = model.config
    cost = roofline.model_cost(model)
    assert cost.body_params == _by_hand_body_params(c)
    assert cost.head == (c.hidden_size, c.vocab_size)
    assert cost.weight_bytes == 4 * (cost.body_params + c.hidden_size * c.vocab_size)
    assert cost.kv_bytes_per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    if name == "tiny:gemma3":
        assert cost.windows == (16, 16, None, 16)
    else:
        assert cost.windows == (None, None)


def test_distinct_prefix_positions():
    prompts = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [7]]
    # position 0: {1, 7}; 1: {1 2}; 2: {1 2 3, 1 2 5}; 3: {1 2 3 4}
    assert roofline.distinct_prefix_positions(prompts) == {0: 2, 1: 1, 2: 2, 3: 1}


def test_workload_work_by_hand():
    cost = roofline.ModelCost(body=((4, 8), (8, 4)), head=(4, 10), num_heads=2, head_dim=3, windows=(None, 2),
                              kv_bytes_per_token=24, weight_bytes=4 * (64 + 40))
    prompts = [[5, 6, 7], [5, 6, 9, 9]]  # the first two tokens are shared
    gens = [2, 3]
    w = roofline.workload_work(cost, prompts, gens)

    def attn(p):  # layer 0 full (p + 1 keys), layer 1 window 2
        return 4 * 2 * 3 * ((p + 1) + min(p + 1, 2))

    distinct_positions = [0, 1, 2, 2, 3]
    assert w.prompt_tokens == 7 and w.distinct_prompt_tokens == 5
    assert w.flops_prefill == 2 * 64 * 5 + sum(attn(p) for p in distinct_positions)
    decode_positions = [3] + [4, 5]  # request 1: G - 1 = 1 token at 3; request 2: 2 tokens at 4, 5
    assert w.decode_tokens == 3 and w.output_tokens == 5 and w.min_forwards == 3
    assert w.flops_decode == 2 * 64 * 3 + sum(attn(p) for p in decode_positions) + 2 * 4 * 10 * 5
    assert w.bytes == 3 * 4 * 104 + 2 * 24 * (5 + 3)
    assert w.flops == w.flops_prefill + w.flops_decode


def test_workload_work_rejects_bad_input():
    cost = roofline.ModelCost(((1, 1),), (1, 1), 1, 1, (None,), 1, 1)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        roofline.workload_work(cost, [[1], [2]], [1])
    with pytest.raises(ValueError, match="at least one token"):
        roofline.workload_work(cost, [[1]], [0])


def test_floor_arithmetic():
    w = roofline.Work(10, 10, 4, 3, 4, flops_prefill=6e9, flops_decode=1e9, bytes=2e9)
    f = roofline.floor(w, prefill_flops_per_s=3e9, decode_flops_per_s=0.5e9, bytes_per_s=4e9)
    assert f["compute_s"] == pytest.approx(2.0 + 2.0)
    assert f["bytes_s"] == pytest.approx(0.5)
    assert f["floor_s"] == pytest.approx(4.0) and f["floor_tok_per_s"] == pytest.approx(1.0)
    f = roofline.floor(w, 3e9, 0.5e9, bytes_per_s=0.1e9)  # memory-bound
    assert f["floor_s"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        roofline.floor(w, 1.0, 1.0, 0.0)


def test_gemm_probe_counts_the_model_shapes():
    model = tiny_model("tiny:llama")
    cost = roofline.model_cost(model)
    body = roofline.gemm_rate(model, rows=7, include_head=False, reps=1)
    full = roofline.gemm_rate(model, rows=7, include_head=True, reps=1)
    assert body["flops"] == 2 * 7 * cost.body_params
    assert full["flops"] == 2 * 7 * (cost.body_params + cost.head[0] * cost.head[1])
    assert body["flops_per_s"] == pytest.approx(body["flops"] / body["seconds"])
    from cbnb.runner.cpu import cpu_linear

    # the floor takes the fastest of F.linear, the runner's own oneDNN linear and that linear over fused weights
    impls = ("F.linear",) + (("oneDNN",) if cpu_linear.available() else ()) \
        + (("oneDNN fused",) if cpu_linear.packing() else ())
    assert body["impl"] in impls


def test_gemm_probe_times_only_f_linear_with_the_fast_path_off(monkeypatch):
    monkeypatch.setenv("CBNB_ONEDNN_LINEAR", "0")
    assert roofline.gemm_rate(tiny_model("tiny:llama"), rows=3, include_head=True, reps=1)["impl"] == "F.linear"


# ----------------------------------------------------------------------------------------------- end to end
def test_bench_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rates, "bandwidth", lambda **kw: 1e10)  # no 1 GiB copy in the test suite (`probe` calls it)
    path = tmp_path / "bench.json"
    assert bench.main(["--model", "tiny:llama", "--scale", "0.1", "--repeat", "2", "--lone", "1", "--threads", "1",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(path.read_text())
    names = ["cbnb", "hf-cb", "hf-static"]
    assert rep["peers"] == names and rep["repeat"] == 2
    assert [r["order"] for r in rep["rounds"]] == [names, names[1:] + names[:1]]
    for name in names:
        s = rep["summary"][name]
        tps = [r["results"][name]["output_tok_per_s"] for r in rep["rounds"]]
        assert s["tok_per_s"]["median"] == pytest.approx(statistics.median(tps))
        ratios = [r["results"]["cbnb"]["output_tok_per_s"] / r["results"][name]["output_tok_per_s"]
                  for r in rep["rounds"]]
        assert s["first_over_this"]["median"] == pytest.approx(statistics.median(ratios))
        shares = [rep["roofline"]["floor_s"] / r["results"][name]["seconds"] for r in rep["rounds"]]
        assert s["roofline_share"]["median"] == pytest.approx(statistics.median(shares))
        assert s["greedy_agreement_min"] == 1.0 and not s["errors"]
        assert name in out
    for r in rep["rounds"]:
        m = r["machine"]
        assert m["copy_bytes_per_s"] == 1e10 and m["prefill_flops_per_s"] > 0
        assert r["floor_s"] == pytest.approx(max(m["compute_s"], m["bytes_s"]))
    # The shares use the floor at the best rates of all probes in the run (round starts and before each peer).
    rf = rep["roofline"]
    probes = [r["machine"] for r in rep["rounds"]] + rf["between_probes"]
    assert rf["probes"] == len(probes)
    assert rf["best_rates"]["prefill_flops_per_s"] == max(m["prefill_flops_per_s"] for m in probes)
    assert rf["floor_s"] == pytest.approx(max(rf["compute_s"], rf["bytes_s"]))
    assert rf["floor_s"] <= min(r["floor_s"] for r in rep["rounds"]) * (1 + 1e-9)
    assert rep["summary"]["cbnb"]["lone_ttft_s"]["n"] == 2
    assert rep["roofline"]["work"]["output_tokens"] == rep["output_tokens"]
    assert "roofline floor" in out and "flops_prefill = " in out


def test_profile_categories_and_a_tiny_run(capsys):
    from cbnb.bench import profile

    assert profile.category("aten::mm") == profile.category("mkldnn::_linear_pointwise") == "gemm"
    assert profile.category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention (sdpa)"
    assert profile.category("aten::index_copy_") == "kv write/gather"
    assert profile.category("aten::silu") == "elementwise"
    assert profile.category("aten::argmax") == "other ops"
    assert profile.main(["--model", "tiny:llama", "--scale", "0.1", "--threads", "1", "--rows", "5"]) == 0
    out = capsys.readouterr().out
    assert "prefill step:" in out and "decode step:" in out and "gemm" in out
    assert "aten::mm" in out or "mkldnn::_linear_pointwise" in out
