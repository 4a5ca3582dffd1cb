"""Traces that say which requests share a prefix: the ``prefix`` / ``hash_ids`` columns, a chat-burst-like workload
written out and read back with the same prefix hits, and Mooncake-style JSONL whose shared hash ids become prefix
hits (on the simulator)."""

from __future__ import annotations

import json

import pytest

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.mooncake import from_mooncake, read_mooncake
from cbnb.sim import SimEngine
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import from_trace, synthetic, trace_rows


def _sim():
    return SimEngine("smollm2-135m", "h100-sxm", ContinuousBatchingConfig(page_size=16, max_memory_percent=0.05),
                     dtype="bfloat16")


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _chat_like():
    return synthetic("chat-like", 24, tr.Gamma(40.0, 3.0), tr.LogNormal(40, 0.6, 8, 128), tr.LogNormal(8, 0.5, 2, 32),
                     shared_prefix_tokens=64, shared_fraction=0.5, seed=7)


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_chat_burst_like_traffic_round_trips_with_the_same_prefix_hits(tmp_path, ext):
    wl = _chat_like()
    path = tmp_path / f"chat.{ext}"
    tr.write_trace(path, trace_rows(wl, block_size=16))
    back = from_trace(path, seed=3)
    assert back.traffic["shared_requests"] == 24  # every row carries hash ids
    assert [len(p) for p in back.prompts] == [len(p) for p in wl.prompts]
    assert back.max_new_tokens == wl.max_new_tokens and back.arrival_s == pytest.approx(wl.arrival_s)
    assert back.prompts != wl.prompts  # new ids, same structure:
    for i in range(24):
        for j in range(i):
            assert _lcp(back.prompts[i], back.prompts[j]) // 16 == _lcp(wl.prompts[i], wl.prompts[j]) // 16
    a = run_workload(_sim(), wl, log=False)
    b = run_workload(_sim(), back, log=False)
    hits_a = [r.prefix_cached_tokens for r in a.records]
    hits_b = [r.prefix_cached_tokens for r in b.records]
    assert sum(hits_a) > 0 and hits_a == hits_b
    assert a.metrics["prefix_hit_tokens"] == b.metrics["prefix_hit_tokens"]


def test_prefix_group_column(tmp_path):
    path = tmp_path / "groups.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n"
                    "0,40,2,sys,32\n0.5,50,2,sys,32\n1.0,20,2,,\n1.5,48,2,other,16\n")
    rows = tr.read_trace(path)
    assert rows[0].prefix == "sys" and rows[0].prefix_tokens == 32 and rows[2].prefix is None
    wl = from_trace(path)
    assert wl.prompts[0][:32] == wl.prompts[1][:32] and wl.prompts[0][32] != wl.prompts[1][32]
    assert wl.prompts[3][:16] != wl.prompts[0][:16]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n0,10,2,sys,32\n")
    with pytest.raises(tr.TraceError, match=r"line 2, column 'prefix_tokens'.*<= prompt_tokens"):
        tr.read_trace(bad)
    bad.write_text("arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n0,10,2,sys,\n")
    with pytest.raises(tr.TraceError, match="prefix_tokens"):
        tr.read_trace(bad)


def test_mooncake_hash_ids_become_prefix_hits(tmp_path):
    bs = 16
    lines = [  # timestamp ms, lengths, hash ids of 16-token blocks
        {"timestamp": 1000, "input_length": 48, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 60, "output_length": 4, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 2000, "input_length": 64, "output_length": 4, "hash_ids": [1, 2, 3, 6]},
        {"timestamp": 2600, "input_length": 10, "output_length": 4, "hash_ids": [7]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = read_mooncake(path, block_size=bs)
    assert [r.arrival_s for r in rows] == [0.0, 0.5, 1.0, 1.6]
    assert rows[1].hash_ids == (1, 2, 4, 5) and rows[1].prompt_tokens == 60 and rows[1].block_size == bs
    wl = from_mooncake(path, block_size=bs)
    assert wl.prompts[0][:32] == wl.prompts[1][:32] and wl.prompts[0][32:48] != wl.prompts[1][32:48]
    assert wl.prompts[2][:48] == wl.prompts[0]
    # One at a time (closed loop, 1 in flight): each request finds the blocks its predecessors left in the cache.
    run = run_workload(_sim(), wl, log=False, max_concurrency=1)
    assert [r.prefix_cached_tokens for r in run.records] == [0, 2 * bs, 3 * bs, 0]
    with pytest.raises(tr.TraceError, match="block_size"):
        read_mooncake(path, block_size=4)  # 3 ids of 4 tokens cannot cover 48 tokens
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    with pytest.raises(tr.TraceError, match="input_length"):
        read_mooncake(path)
