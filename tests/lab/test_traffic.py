"""Arrival processes, length distributions, trace files and the timed standard workloads (torch-free, seeded).

Statistics are checked at n = 10,000 against their parameters within sampling error: each bound is 4 standard
errors (a seeded draw, so the test is deterministic; 4 SE keeps it meaningful, not lucky)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics

import pytest

from cbnb.lab import traffic as tr
from cbnb.lab.workloads import WORKLOADS, from_trace, get_workload, synthetic, with_arrivals

N = 10_000


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_poisson_rate_and_cv(rate):
    t = tr.Poisson(rate).times(N + 1, random.Random(1))
    g = _gaps(t)
    assert t[0] == 0.0 and all(x >= 0 for x in g) and t == sorted(t)
    mean = statistics.fmean(g)
    # Exponential gaps: sd = mean, so SE(mean) = (1/rate)/sqrt(N).
    assert abs(mean - 1 / rate) < 4 * (1 / rate) / math.sqrt(N)
    assert abs(N / t[-1] - rate) < 4 * rate / math.sqrt(N)  # rate estimate
    cv = statistics.pstdev(g) / mean
    assert abs(cv - 1.0) < 0.05  # SE(cv) ~ 1/sqrt(N) * ~1.1 for the exponential: 4 SE ~ 0.045


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_rate_and_cv(cv):
    rate = 2.0
    g = _gaps(tr.Gamma(rate, cv).times(N + 1, random.Random(2)))
    mean = statistics.fmean(g)
    assert abs(mean - 1 / rate) < 4 * (cv / rate) / math.sqrt(N)  # sd of the gaps = cv * mean
    # SE of a sample cv: roughly cv * sqrt((1 + 2 cv^2)/ (2N)) for gamma-like tails; 4 of those.
    se_cv = cv * math.sqrt((1 + 2 * cv * cv) / (2 * N))
    assert abs(statistics.pstdev(g) / mean - cv) < 4 * se_cv + 0.02
    assert tr.Gamma(rate, cv).shape == pytest.approx(1 / cv ** 2)


def test_offline_is_all_zero():
    assert tr.Offline().times(5, random.Random(0)) == [0.0] * 5


def test_lognormal_moments_match_parameters():
    d = tr.LogNormal(mean=200.0, sigma=0.6)
    xs = d.sample_real(N, random.Random(3))
    logs = [math.log(x) for x in xs]
    assert abs(statistics.fmean(logs) - d.mu) < 4 * d.sigma / math.sqrt(N)
    # SE of a normal sample's sd: sigma / sqrt(2N).
    assert abs(statistics.pstdev(logs) - d.sigma) < 4 * d.sigma / math.sqrt(2 * N)
    # The mean of x itself is `mean` (mu = ln(mean) - sigma^2/2); sd(x) = mean * sqrt(e^{sigma^2} - 1).
    sd_x = 200.0 * math.sqrt(math.exp(0.36) - 1)
    assert abs(statistics.fmean(xs) - 200.0) < 4 * sd_x / math.sqrt(N)
    ints = d.sample(N, random.Random(3))  # rounding moves the mean by far less than its SE
    assert all(isinstance(i, int) and i >= 1 for i in ints)
    assert abs(statistics.fmean(ints) - 200.0) < 4 * sd_x / math.sqrt(N)


def test_lognormal_clips_to_its_range():
    xs = tr.LogNormal(32, 1.5, lo=4, hi=64).sample(2000, random.Random(0))
    assert min(xs) == 4 and max(xs) == 64


def test_uniform_fixed_empirical():
    u = tr.Uniform(3, 9).sample(N, random.Random(4))
    assert set(u) == set(range(3, 10))
    assert abs(statistics.fmean(u) - 6.0) < 4 * statistics.pstdev(range(3, 10)) / math.sqrt(N)
    assert tr.Fixed(7).sample(3, random.Random(0)) == [7, 7, 7]
    e = tr.Empirical((5, 10, 10, 10)).sample(N, random.Random(5))
    assert set(e) == {5, 10} and abs(e.count(10) / N - 0.75) < 4 * math.sqrt(0.75 * 0.25 / N)


def test_generators_are_deterministic_under_a_seed():
    a = tr.Gamma(1.5, 2.0).times(100, random.Random("x"))
    assert a == tr.Gamma(1.5, 2.0).times(100, random.Random("x"))
    assert a != tr.Gamma(1.5, 2.0).times(100, random.Random("y"))


@pytest.mark.parametrize("bad", [lambda: tr.Poisson(0), lambda: tr.Poisson(-1.0), lambda: tr.Gamma(1.0, 0),
                                 lambda: tr.LogNormal(0, 1), lambda: tr.Uniform(5, 2), lambda: tr.Fixed(0),
                                 lambda: tr.Empirical(()), lambda: tr.Poisson(float("nan"))])
def test_bad_parameters_are_errors(bad):
    with pytest.raises(ValueError):
        bad()


def test_specs_round_trip():
    for g in (tr.Offline(), tr.Poisson(2.0), tr.Gamma(1.0, 3.0), tr.Fixed(4), tr.Uniform(1, 5),
              tr.LogNormal(64, 0.5, 8, 256), tr.Empirical((1, 2, 3))):
        assert tr.from_spec(json.loads(json.dumps(g.spec()))) == g
    with pytest.raises(ValueError, match="spec kind must be one of"):
        tr.from_spec({"kind": "weibull"})


# ------------------------------------------------------------------------------------------------ traces
def test_trace_jsonl_and_csv(tmp_path):
    rows = [tr.TraceRow(0.0, 8, prompt_tokens=20), tr.TraceRow(0.5, 4, prompt="Hello there"),
            tr.TraceRow(0.25, 16, prompt_tokens=3)]
    for ext in ("jsonl", "csv"):
        p = tmp_path / f"t.{ext}"
        tr.write_trace(p, rows)
        assert tr.read_trace(p) == rows
    wl = from_trace(tmp_path / "t.csv", vocab_size=100)
    assert wl.arrival_s == [0.0, 0.5, 0.25] and wl.max_new_tokens == [8, 4, 16]
    assert len(wl.prompts[0]) == 20 and wl.prompts[1] == "Hello there" and len(wl.prompts[2]) == 3
    assert all(32 <= i < 100 for i in wl.prompts[0])
    assert wl.traffic["arrivals"]["kind"] == "trace"
    tok = lambda text: {"input_ids": [ord(c) for c in text]}  # noqa: E731 - a stand-in tokenizer
    assert from_trace(tmp_path / "t.jsonl", tokenizer=tok).prompts[1] == [ord(c) for c in "Hello there"]
    assert tr.Empirical.from_trace(tmp_path / "t.csv", "prompt_tokens").values == (20, 3)


@pytest.mark.parametrize("text, line, column, message", [
    ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival_s": -1, "prompt_tokens": 4, '
     '"output_tokens": 2}\n', 2, "arrival_s", ">= 0 seconds"),
    ('{"arrival_s": 0, "prompt_tokens": 4}\n', 1, "output_tokens", "missing"),
    ('# comment\n\n{"arrival_s": 0, "prompt_tokens": 2.5, "output_tokens": 2}\n', 3, "prompt_tokens",
     "integer >= 1"),
    ('{"arrival_s": 0, "prompt_tokens": 4, "prompt": "x", "output_tokens": 2}\n', 1, "prompt", "exactly one"),
    ('{"arrival_s": 0, "output_tokens": "many", "prompt_tokens": 3}\n', 1, "output_tokens", "integer"),
    ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2\n', 1, None, "not valid JSON"),
    ('[1, 2, 3]\n', 1, None, "JSON object"),
])
def test_bad_jsonl_rows_name_line_and_column(tmp_path, text, line, column, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(tr.TraceError, match=message) as e:
        tr.read_trace(p)
    assert e.value.line == line and e.value.column == column
    assert f"line {line}" in str(e.value) and str(p) in str(e.value)
    if column:
        assert repr(column) in str(e.value)


@pytest.mark.parametrize("text, line, column, message", [
    ("arrival_s,prompt_tokens,output_tokens\n0,4,2\n0.5,abc,2\n", 3, "prompt_tokens", "integer"),
    ("arrival_s,prompt_tokens,output_tokens\n0,4,2\n1,4,0\n", 3, "output_tokens", "integer >= 1"),
    ("arrival_s,prompt_tokens,output_tokens\n,4,2\n", 2, "arrival_s", "missing"),
    ("arrival_s,prompt_tokens,output_tokens\n0,4,2,9\n", 2, None, "4 cells but the header has 3"),
    ("arrival,prompt_tokens,output_tokens\n0,4,2\n", 1, "arrival_s", "header has no"),
    ("arrival_s,output_tokens\n0,2\n", 1, "prompt_tokens", "needs a 'prompt_tokens' or a 'prompt'"),
    ("arrival_s,prompt_tokens,output_tokens\n", 1, None, "no requests"),
    ("arrival_s,prompt_tokens,output_tokens\n0,4,2\ninf,4,2\n", 3, "arrival_s", "finite"),
])
def test_bad_csv_rows_name_line_and_column(tmp_path, text, line, column, message):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(tr.TraceError, match=message) as e:
        tr.read_trace(p)
    assert (e.value.line, e.value.column) == (line, column)


def test_trace_format_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="'jsonl' or 'csv'"):
        tr.read_trace(tmp_path / "t.txt")


# ------------------------------------------------------------------------------------------------ workloads
# sha256 of the offline workloads' prompts, lengths and hints (scale 0.25) as built before arrivals existed
# (commit 6bf852c's cbnb/lab/workloads.py): unchanged.
OFFLINE_DIGESTS = {
    "cpu-32": "5a16a8a7", "shared-prefix": "a1cf9c84", "long-gen": "9166d7dd", "nanovllm-256": "ea02a948",
}


def _digest(wl) -> str:
    blob = json.dumps([wl.prompts, wl.max_new_tokens, wl.config_hints]).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


@pytest.mark.parametrize("name", sorted(OFFLINE_DIGESTS))
def test_offline_workloads_unchanged(name):
    wl = get_workload(name, scale=0.25)
    assert _digest(wl) == OFFLINE_DIGESTS[name]
    assert wl.arrival_s == [0.0] * wl.num_requests and wl.offline


def test_timed_workloads():
    assert {"cpu-poisson", "chat-burst"} <= set(WORKLOADS)
    p = get_workload("cpu-poisson")
    assert p.num_requests == 64 and not p.offline and p.arrival_s[0] == 0.0
    assert p.traffic["arrivals"]["kind"] == "poisson" and p.model == "smollm2-135m"
    lens = [len(x) for x in p.prompts]
    assert 16 <= min(lens) and max(lens) <= 512 and min(p.max_new_tokens) >= 4
    c = get_workload("chat-burst")
    assert c.traffic["arrivals"] == {"kind": "gamma", "rate": c.traffic["arrivals"]["rate"], "cv": 3.0}
    head = [tuple(x[:256]) for x in c.prompts]
    common = max(set(head), key=head.count)
    assert head.count(common) == 32  # half share the 256-token system prompt
    assert get_workload("cpu-poisson").prompts == p.prompts  # deterministic
    assert get_workload("cpu-poisson", seed=1).prompts != p.prompts
    faster = get_workload("cpu-poisson", rate=4.0)
    assert faster.prompts == p.prompts and faster.duration_s < p.duration_s
    with pytest.raises(ValueError, match="rate must be"):
        get_workload("cpu-poisson", rate=0)


def test_with_arrivals_keeps_requests():
    wl = get_workload("cpu-32", scale=0.25)
    timed = with_arrivals(wl, tr.Poisson(2.0))
    assert timed.prompts == wl.prompts and timed.max_new_tokens == wl.max_new_tokens
    assert timed.arrival_s != wl.arrival_s and timed.arrival_s == sorted(timed.arrival_s)
    assert with_arrivals(timed, tr.Offline()).offline


def test_synthetic_checks_and_scale():
    wl = synthetic("x", 40, tr.Poisson(1.0), tr.Fixed(10), tr.Uniform(2, 4), vocab_size=64, scale=0.5)
    assert wl.num_requests == 20 and {len(p) for p in wl.prompts} == {5}
    with pytest.raises(ValueError, match="n must be"):
        synthetic("x", 0, tr.Offline(), tr.Fixed(1), tr.Fixed(1))
    with pytest.raises(ValueError, match="arrival_s\\[0\\]"):
        type(wl)("w", "m", [[1]], [1], arrival_s=[-1.0])
