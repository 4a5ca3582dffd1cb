"""The panels' state logic without widgets or a browser: text, request rows, plot series, the KV map encoding."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from cbnb.telemetry.events import StepPlanned
from cbnb.core.requests import RequestOutput, RequestState, RequestTimings
from cbnb.ui.state import (BOARD_COLUMNS, SKIP_REASONS, StepSeries, TextTracker, TimeSeries, encode_kv, fmt_bytes,
                           kv_block_details, request_rows, stream_items)

from helpers_ui import synthetic_snapshot


class CharTokenizer:
    """Token id i decodes to chr(i); id 0xFFFD stands for an incomplete UTF-8 byte."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return "".join(chr(i) for i in ids)


def out(rid, state, n_out=0, prompt=5, ttft=None, queued=1.0, text="", **kw):
    tm = RequestTimings(queued=queued, scheduled=queued + 0.01 if state != RequestState.PENDING else None,
                        first_token=queued + ttft if ttft is not None else None)
    return RequestOutput(rid, list(range(prompt)), [65 + (i % 26) for i in range(n_out)], text=text, state=state,
                         timings=tm, **kw)


# ---------------------------------------------------------------------------------------------- text
def test_text_tracker_decodes_only_new_tails_and_caches():
    tok = CharTokenizer()
    tt = TextTracker(tok)
    ids = [72, 105]
    assert tt.text("a", ids) == "Hi"
    assert tt.text("a", ids) == "Hi" and tok.calls == [2]  # unchanged: no decode
    long = ids + [33] * 30
    assert tt.text("a", long) == "Hi" + "!" * 30  # > 16 new tokens: the text becomes stable
    tok.calls.clear()
    assert tt.text("a", long + [63]) == "Hi" + "!" * 30 + "?"
    assert tok.calls == [1]  # only the new tail was decoded


def test_text_tracker_holds_back_incomplete_utf8_and_prefers_final_text():
    tt = TextTracker(CharTokenizer())
    assert tt.text("a", [72, 0xFFFD]) == "H"
    assert tt.text("a", [72, 0xFFFD, 105], final_text="Hé!") == "Hé!"


def test_text_tracker_cuts_long_text_and_prunes():
    tt = TextTracker(CharTokenizer(), max_chars=10)
    t = tt.text("a", [66] * 50)
    assert len(t) == 10 and t.startswith("…")
    tt.prune(["b"])
    assert tt._cache == {}


def test_text_tracker_without_tokenizer_shows_ids():
    assert TextTracker(None).text("a", [1, 2, 3]) == "1 2 3"


# ---------------------------------------------------------------------------------------------- rows
def test_request_rows_order_counts_progress_and_units():
    reqs = [out("r0", RequestState.DECODING, 3, ttft=0.25, prefix_cached_tokens=16, num_offloads=1, max_new_tokens=10),
            out("r1", RequestState.PENDING),
            out("r2", RequestState.FINISHED, 8, ttft=0.5, text="done", max_new_tokens=8),
            out("r3", RequestState.CANCELLED, 1, error="cancelled by user"),
            out("r4", RequestState.FAILED, 0, error="too long", num_soft_resets=2)]
    rows, counts, hidden = request_rows(reqs, max_finished=2)
    ix = {c: i for i, c in enumerate(BOARD_COLUMNS)}
    # live first (arrival order), then ended newest first, capped
    assert [r[ix["id"]] for r in rows] == ["r0", "r1", "r4", "r3"]
    assert hidden == 1
    assert counts["DECODING"] == 1 and counts["FINISHED"] == 1 and counts["FAILED"] == 1
    r0 = rows[0]
    assert r0[ix["output_tokens"]] == 3 and r0[ix["max_new_tokens"]] == 10
    assert r0[ix["ttft_ms"]] == 250.0 and r0[ix["prefix_cached_tokens"]] == 16 and r0[ix["offloads"]] == 1
    assert rows[1][ix["ttft_ms"]] is None and rows[1][ix["max_new_tokens"]] is None
    assert rows[2][ix["soft_resets"]] == 2 and rows[2][ix["error"]] == "too long"


def test_request_rows_carry_the_source():
    reqs = [out("http-1", RequestState.DECODING, 1, source="http 127.0.0.1:5000"), out("r1", RequestState.PENDING)]
    rows, _, _ = request_rows(reqs)
    ix = {c: i for i, c in enumerate(BOARD_COLUMNS)}
    assert [r[ix["source"]] for r in rows] == ["http 127.0.0.1:5000", ""]


def test_stream_items_mark_terminal_states_and_use_final_text():
    tt = TextTracker(CharTokenizer())
    reqs = [out("r0", RequestState.DECODING, 2, max_new_tokens=4, prompt_text="What is   the capital of France?"),
            out("r1", RequestState.FINISHED, 3, text="final text"),
            out("r2", RequestState.CANCELLED, 1, error="cancelled")]
    items = stream_items(reqs, tt)
    assert [i["id"] for i in items] == ["r0", "r2", "r1"]
    assert items[0] == {"id": "r0", "state": "DECODING", "text": "AB", "n": 2, "max": 4, "error": "", "reason": "",
                        "prompt": "What is the capital of France?", "lp": [], "plp": []}  # the words typed, whitespace collapsed
    assert items[2]["prompt"] == "\x00\x01\x02\x03\x04"  # ids given: decoded by the tokenizer
    assert items[2]["text"] == "final text" and items[1]["error"] == "cancelled"


def test_stream_items_carry_the_newest_tokens_logprobs():
    from cbnb.core.requests import TokenLogprob
    from cbnb.ui.state import LOGPROB_TOKENS

    n = LOGPROB_TOKENS + 3
    lps = [TokenLogprob(65 + i % 26, -0.5 * i, ((66, -0.1),)) for i in range(n)]
    items = stream_items([out("r0", RequestState.DECODING, n, logprobs=lps, processors=("greedy", "logprobs=1"))],
                         TextTracker(CharTokenizer()))
    lp = items[0]["lp"]
    assert len(lp) == LOGPROB_TOKENS and lp[0]["i"] == 3 and lp[-1]["i"] == n - 1
    assert lp[0] == {"t": "D", "i": 3, "lp": -1.5, "top": [["B", -0.1]]}
    rows, _, _ = request_rows([out("r0", RequestState.DECODING, 1, processors=("greedy", "logprobs=1"))])
    assert rows[0][BOARD_COLUMNS.index("sampling")] == "greedy · logprobs=1"


def test_stream_items_carry_the_prompts_last_logprobs_at_their_positions():
    from cbnb.core.requests import TokenLogprob
    from cbnb.ui.state import LOGPROB_TOKENS, prompt_logprob_tokens

    n = LOGPROB_TOKENS + 5  # prompt positions 1..n have logprobs; position 0 has none
    lps = [TokenLogprob(65 + i % 26, -0.25 * i, ((66, -0.1),)) for i in range(1, n + 1)]
    o = out("r0", RequestState.FINISHED, 1, prompt_logprobs=[None, *lps])  # as `RequestOutput` gives them
    plp = stream_items([o], TextTracker(CharTokenizer()))[0]["plp"]
    assert len(plp) == LOGPROB_TOKENS and [plp[0]["i"], plp[-1]["i"]] == [n + 1 - LOGPROB_TOKENS, n]
    assert plp[-1] == {"t": chr(65 + n % 26), "i": n, "lp": -0.25 * n, "top": [["B", -0.1]]}

    class Live:  # the engine's own Request keeps no entry for position 0
        prompt_logprobs = lps
    assert prompt_logprob_tokens(Live(), TextTracker(CharTokenizer())) == plp
    assert stream_items([out("r1", RequestState.FINISHED, 1)], TextTracker(CharTokenizer()))[0]["plp"] == []


# ---------------------------------------------------------------------------------------------- plot series
def step_event(step, prefill, decode, skipped=()):
    return StepPlanned(step, 0.0, "fifo", [], list(skipped), [], 256, prefill + decode, prefill, decode,
                       requests_used=2)


def test_step_series_counts_left_out_requests_by_reason():
    s = StepSeries(size=3)
    n = s.add_events([step_event(1, 200, 2, [("token_budget", ["a", "b"], {}), ("request_cap", ["c"], {})]),
                      step_event(2, 0, 3)])
    assert n == 2
    assert s.column("prefill").tolist() == [200, 0] and s.column("budget").tolist() == [256, 256]
    assert s.column("skip_token_budget").tolist() == [2, 0] and s.column("skip_request_cap").tolist() == [1, 0]
    s.add_events([step_event(k, 1, 1) for k in range(3, 6)])
    assert s.column("step").tolist() == [3, 4, 5]  # bounded window
    arrays = s.arrays()
    assert set(arrays) == {"step", "t", "run", "prefill", "decode", "budget", "requests"} | {
        f"skip_{r}" for r in SKIP_REASONS}
    assert np.frombuffer(arrays["step"], dtype=np.float32).tolist() == [3, 4, 5]
    s.add_events([step_event(1, 10, 0)])  # a reconfigured engine counts from 1 again: start afresh
    assert s.column("step").tolist() == [1]


def stats(out_tokens, prefill=0, ttft=None, hit=0, swaps=0):
    run = {"kv_usage_blocks_frac": 0.5, "kv_usage_tokens_frac": 0.25, "prefix_hit_tokens": hit,
           "prefix_hit_rate_pct": 10.0 if hit else 0.0, "swaps": swaps, "soft_resets": 0, "restores": 0,
           "cuda_graph_captures": 0, "cuda_graph_replays": 0, "ttft_s": {"p50": ttft}, "tpot_s": {"p50": None}}
    return {"run": run, "cumulative": {"output_tokens": out_tokens, "prefill_tokens": prefill}}


def test_time_series_rates_percentages_and_missing_values():
    ts = TimeSeries(t0=100.0, window_s=1.0)
    ts.add_stats(100.0, stats(0))
    row = ts.add_stats(100.5, stats(10, 100, ttft=0.2, hit=32))
    assert row["t"] == 0.5 and row["out_tok_s"] == pytest.approx(20.0) and row["prefill_tok_s"] == pytest.approx(200)
    assert row["kv_blocks_pct"] == 50.0 and row["ttft_p50_ms"] == pytest.approx(200.0)
    tpot = np.frombuffer(ts.arrays()["tpot_p50_ms"], dtype=np.float32)
    assert np.isnan(tpot).all()  # unknown -> NaN (a gap in the plot)
    # The rate is measured from the newest sample at least window_s old: an idle gap counts, older samples drop.
    ts.add_stats(102.0, stats(10, 100))
    row = ts.add_stats(102.5, stats(20, 100))
    assert row["out_tok_s"] == pytest.approx(10 / 2.0)
    row = ts.add_stats(103.5, stats(40, 100))
    assert row["out_tok_s"] == pytest.approx(20 / 1.0)


def test_time_series_follows_the_engines_clock_when_the_stats_carry_one():
    # A simulation played 10x faster than real time: 10 simulated seconds per wall second.
    ts = TimeSeries(t0=100.0, window_s=1.0)
    first = ts.add_stats(100.5, dict(stats(0), clock_s=7.0))
    assert first["t"] == 0.5  # aligned with the wall clock at the first sample
    row = ts.add_stats(101.0, dict(stats(400), clock_s=12.0))
    assert row["t"] == pytest.approx(5.5)  # then the engine's seconds
    assert row["out_tok_s"] == pytest.approx(400 / 5.0)  # tokens per simulated second, not per wall second


# ---------------------------------------------------------------------------------------------- KV map
def test_encode_kv_round_trips_state_and_clamped_refcount():
    snap = synthetic_snapshot(5000)
    meta, cells = encode_kv(snap)
    g = snap.groups[0]
    a = np.frombuffer(cells, dtype=np.uint8)
    assert len(a) == 5000
    assert (a & 7).tolist() == g.state.tolist()
    assert ((a >> 3) == np.minimum(g.refcount, 31)).all()
    assert meta[0]["counts"]["reserved"] == 2 and meta[0]["num_blocks"] == 5000 and meta[0]["offset"] == 0
    assert meta[0]["padding_blocks"] == [0, 1] and meta[0]["tokens_filled"] == int(g.tokens.sum())


def test_kv_block_details_names_owners_and_rejects_bad_indices():
    snap = synthetic_snapshot(2000)
    g = snap.groups[0]
    b = next(iter(g.shared_owners))
    d = kv_block_details(snap, 0, b)
    assert d["state"] == "shared" and len(d["owners"]) == 2 and d["owners"][0] == f"req-{g.owner[b]}"
    assert d["tokens"] == int(g.tokens[b]) and d["page_size"] == 16
    assert kv_block_details(snap, 0, 0)["padding"] is True and kv_block_details(snap, 0, 0)["owners"] == []
    with pytest.raises(ValueError, match="block must be in"):
        kv_block_details(snap, 0, 2000)
    with pytest.raises(ValueError, match="group must be in"):
        kv_block_details(snap, 1, 0)


def test_encode_and_update_of_100k_blocks_fits_10hz():
    """The poller's page-map path for 100,000 blocks: encode + traitlet update (incl. widget-state serialisation)."""
    from cbnb.ui.kvmap import KVPageMapPanel
    from cbnb.ui.poller import Frame

    class Eng:  # the panel only needs an event log to subscribe to
        from cbnb.telemetry.events import EventLog

        events = EventLog(10)

    panel = KVPageMapPanel(Eng(), autostart=False)
    snaps = [synthetic_snapshot(100_000, seed=s) for s in range(6)]
    sent: list[int] = []
    panel.observe(lambda ch: sent.append(len(ch["new"])), names="cells")
    times = []
    for s in snaps:
        t = time.perf_counter()
        panel._update(Frame(wall=time.time(), snapshot=s))
        panel.get_state("cells")  # what ipywidgets serialises for the front-end
        times.append(time.perf_counter() - t)
    assert sent == [100_000] * 6
    assert np.frombuffer(panel.cells, dtype=np.uint8)[5] & 7 == snaps[-1].groups[0].state[5]
    # unchanged snapshot: nothing is sent
    panel._update(Frame(wall=time.time(), snapshot=snaps[-1]))
    assert len(sent) == 6
    median_ms = 1000 * statistics.median(times)
    print(f"100k blocks encode+update: median {median_ms:.1f} ms, max {1000 * max(times):.1f} ms")
    assert median_ms < 50, f"{median_ms:.1f} ms per update leaves no room for 10 Hz"
    panel.close()


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 << 20) == "3.0 MiB" and fmt_bytes(1.5 * (1 << 30)) == "1.5 GiB"
