"""The CUDA runner's logic on CPU: padding arithmetic, graph keys and cache, static buffers, async pair rotation and
carry-over, driven by the fake graph backend and the kernels' PyTorch references (``attention="torch"``), plus one
engine run through the Triton kernels under the interpreter.

What the fake backend keeps from real graphs: capturing runs nothing; a replay re-runs the closure captured for that
padded shape with its captured Python values, so anything the forward takes from outside the static buffers would
replay stale values and break token equality here. What it cannot show: host synchronisation inside a capture, real
stream overlap, and speed (the device check script covers those).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cbnb  # noqa: E402
from cbnb.core.requests import Request, RequestState, SamplingParams  # noqa: E402
from cbnb.runner.cuda import graphs as gr  # noqa: E402
from cbnb.runner.cuda import triton_attention as ta  # noqa: E402
from cbnb.runner.cuda.cuda_runner import CudaModelRunner  # noqa: E402
from cbnb.runner.factory import make_runner, runner_kind  # noqa: E402
from cbnb.runner.model_runner import ModelRunner  # noqa: E402

from helpers_engine import (  # noqa: E402
    STD_NEW, STD_PROMPTS, assert_cache_empty, config, oracle_for, random_prompts, results, submit_together,
    tiny_model,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


def gpu_engine(model, cfg, *, graphs=True, async_=True, attention="torch", **runner_kw):
    """An engine whose runner is the CUDA runner on CPU (fake graphs)."""
    eng = cbnb.Engine(model, config=cfg)
    r = CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, seed=eng.config.seed, attention=attention,
                        **runner_kw)
    r.configure(eng.config, use_cuda_graph=graphs, use_async_batching=async_)
    eng.runner = r
    return eng, r


def run(model, cfg, prompts=STD_PROMPTS, n=STD_NEW, **kw):
    sampling = kw.pop("sampling", {})
    eng, r = gpu_engine(model, cfg, **kw)
    with eng:
        outs = results(submit_together(eng, prompts, n, **sampling))
    assert_cache_empty(eng)
    return eng, r, outs


def assert_oracle(name, prompts, outs, n):
    oracle = oracle_for(name)
    ns = n if isinstance(n, list) else [n] * len(prompts)
    for i, (p, o, k) in enumerate(zip(prompts, outs, ns)):
        assert o.state == RequestState.FINISHED, (i, o.state, o.error)
        assert o.token_ids == oracle(p, k), f"request {i} differs from model.generate"


# ------------------------------------------------------------------------------------------------ arithmetic
def test_pad_to_interval_semantics():
    assert gr.pad_to_interval(0, 64) == 64  # 0 -> one full interval (transformers)
    assert gr.pad_to_interval(1, 64) == 64
    assert gr.pad_to_interval(64, 64) == 64
    assert gr.pad_to_interval(65, 64) == 128
    assert gr.pad_to_interval(100, 64, cap=120) == 120  # capped at max_batch_tokens
    assert gr.pad_to_interval(0, 16384, cap=40960) == 16384
    assert gr.pad_to_interval(20000, 16384, cap=40960) == 32768
    assert gr.pad_to_interval(40000, 16384, cap=40960) == 40960
    with pytest.raises(ValueError):
        gr.pad_to_interval(3, 0)
    assert [gr.next_pow2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert gr.next_pow2(700, cap=1000) == 1000 and gr.next_pow2(5, cap=6) == 6


def test_config_presets_resolve_to_transformers_values():
    r = cbnb.ContinuousBatchingConfig().resolve("cuda")
    assert (r.q_padding_interval_size, r.kv_padding_interval_size) == (64, 16384)
    assert r.use_cuda_graph == (True, True) and r.use_async_batching is True
    c = cbnb.ContinuousBatchingConfig().resolve("cpu")
    assert c.use_cuda_graph == (False, False) and c.use_async_batching is False


def _planner(**kw):
    args = dict(q_interval=64, kv_interval=256, max_tokens=512, max_seqs=64, kv_cap=1024, page_size=16,
                windows=(0, 32), num_kv_heads=2, num_sms=8, block_m=64, split_fn=ta.num_decode_splits)
    args.update(kw)
    return gr.ShapePlanner(**args)


def test_planner_shapes_and_graph_keys():
    pl = _planner()
    d = pl.plan(num_tokens=5, num_seqs=5, max_kv=100, decode_only=True, pad=True)
    assert (d.kind, d.num_tokens, d.num_seqs, d.kv_len, d.num_tiles, d.num_dec) == ("decode", 8, 8, 256, 0, 8)
    assert d.key == ("decode", 8, 256)
    assert d.widths == (16, 2)  # full: 256 / 16 pages; sliding: ceil(32 / 16)
    # every real size in the same buckets gives the same key; the next bucket a new one
    assert pl.plan(num_tokens=7, num_seqs=7, max_kv=250, decode_only=True, pad=True).key == d.key
    assert pl.plan(num_tokens=9, num_seqs=9, max_kv=250, decode_only=True, pad=True).key == ("decode", 16, 256)
    assert pl.plan(num_tokens=5, num_seqs=5, max_kv=257, decode_only=True, pad=True).key == ("decode", 8, 512)
    v = pl.plan(num_tokens=70, num_seqs=3, max_kv=90, decode_only=False, pad=True)
    assert (v.kind, v.num_tokens, v.num_seqs, v.kv_len) == ("varlen", 128, 64, 256)
    assert v.num_tiles == 2 + 64 and v.num_dec == 64 and v.key == ("varlen", 128, 256)
    assert pl.plan(num_tokens=0, num_seqs=0, max_kv=0, decode_only=False, pad=True).num_tokens == 64
    assert pl.plan(num_tokens=500, num_seqs=3, max_kv=1000, decode_only=False, pad=True).key == ("varlen", 512, 1024)
    e = pl.plan(num_tokens=70, num_seqs=3, max_kv=90, decode_only=False, pad=False, num_tiles=3, num_dec=1)
    assert (e.num_tokens, e.num_seqs, e.kv_len, e.num_tiles, e.num_dec, e.padded) == (70, 3, 90, 3, 1, False)
    with pytest.raises(ValueError):
        pl.plan(num_tokens=600, num_seqs=3, max_kv=90, decode_only=False, pad=True)
    big = gr.MetaLayout.for_shape(pl.max_shape())
    for s in (d, v, e):  # the static buffers hold every shape
        assert gr.MetaLayout.for_shape(s).total <= big.total


def test_meta_layout_neutral_is_all_padding():
    pl = _planner()
    shape = pl.plan(num_tokens=70, num_seqs=3, max_kv=90, decode_only=False, pad=True)
    lay = gr.MetaLayout.for_shape(shape)
    a = lay.neutral([16 * 5, 16 * 9])
    assert (lay.view(a, "carry") == -1).all() and (lay.view(a, "dec_seq") == -1).all()
    assert (lay.view(a, "tile_seq") == -1).all() and (lay.view(a, "q_len") == 0).all()
    assert (lay.view(a, "slots0") == 80).all() and (lay.view(a, "slots1") == 144).all()
    assert lay.view(a, "table1").shape == (64, 2)
    offs = sorted(o for o, _ in lay.segments.values())
    assert all(o % 16 == 0 for o in offs)  # 64-byte aligned segments


def test_graph_cache_capture_then_replay_and_counts():
    backend = gr.FakeGraphBackend()
    cache = gr.GraphCache(backend)
    calls = {"fn": 0, "warm": 0}

    def fn():
        calls["fn"] += 1
        return calls["fn"]

    def warm():
        calls["warm"] += 1

    out, cap = cache.run(("decode", 8, 256), fn, warm)
    assert cap and out == 1 and calls == {"fn": 1, "warm": 1}  # capture ran nothing; the replay ran it once
    out, cap = cache.run(("decode", 8, 256), lambda: 99, warm)  # hit: the captured closure is replayed
    assert not cap and out == 2 and calls["warm"] == 1
    cache.run(("decode", 16, 256), fn, warm)
    assert (cache.captures, cache.replays, len(cache)) == (2, 3, 2)
    assert cache.keys_captured == [("decode", 8, 256), ("decode", 16, 256)]
    assert backend.log == ["capture", "replay", "replay", "capture", "replay"]


class _FakeCudaGraph:
    """`torch.cuda.CUDAGraph`'s capture protocol; `capture_end` raises like an invalidated capture when told to."""

    def __init__(self, end_raises: bool = False) -> None:
        self.end_raises = end_raises
        self.calls: list[str] = []

    def capture_begin(self, **kw):
        self.calls.append("begin")

    def capture_end(self):
        self.calls.append("end")
        if self.end_raises:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class _CaptureFailingBackend(gr.FakeGraphBackend):
    """Fake graphs whose capture number `n` (0-based) in `fail` fails like a CUDA one: the forward raises inside the
    capture, then `capture_end` raises too."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail
        self.n = 0

    def capture(self, fn):
        n, self.n = self.n, self.n + 1
        if n not in self.fail:
            return super().capture(fn)

        def forward_in_capture():
            raise RuntimeError("operation not permitted when stream is capturing")

        return gr.capture_into(_FakeCudaGraph(end_raises=True), forward_in_capture)[1]


def test_capture_into_keeps_the_forward_error_not_capture_end():
    g = _FakeCudaGraph(end_raises=True)
    with pytest.raises(ValueError, match="boom") as info:
        gr.capture_into(g, lambda: (_ for _ in ()).throw(ValueError("boom")), pool=None)
    assert g.calls == ["begin", "end"]  # the capture was ended anyway
    assert any("capture_end() raised as well" in n for n in info.value.__notes__)
    with pytest.raises(RuntimeError, match="previous error during capture"):  # only capture_end failed: its error
        gr.capture_into(_FakeCudaGraph(end_raises=True), lambda: 1)
    assert gr.capture_into(_FakeCudaGraph(), lambda: 7)[1] == 7


def test_graph_cache_failed_capture_runs_eagerly_and_never_retries():
    cache = gr.GraphCache(_CaptureFailingBackend({0}))
    out, cap = cache.run(("decode", 8, 256), lambda: "eager", None)
    assert (out, cap, ("decode", 8, 256) in cache) == ("eager", False, False)
    err = cache.failures[("decode", 8, 256)]
    assert isinstance(err, gr.GraphCaptureError) and "('decode', 8, 256)" in str(err)
    assert "operation not permitted when stream is capturing" in str(err)  # the cause, not capture_end's error
    assert [e.key for e in cache.take_failures()] == [("decode", 8, 256)] and cache.take_failures() == []
    assert cache.run(("decode", 8, 256), lambda: "again", None) == ("again", False)
    assert (cache.capture_failures, cache.eager_runs, cache.backend.n) == (1, 2, 1)  # no second capture attempt
    assert not cache.capture(("decode", 8, 256), lambda: None)  # nor at pre-capture


def test_failed_captures_fall_back_to_eager_with_the_engine_alive():
    name = "tiny:llama"
    cfg = config(page_size=16, max_batch_tokens=32, q_padding_interval_size=8, kv_padding_interval_size=48)
    eng, r = gpu_engine(tiny_model(name), cfg)
    r.graphs = gr.GraphCache(_CaptureFailingBackend({0, 2}))
    with eng:
        outs = results(submit_together(eng, STD_PROMPTS, STD_NEW))
        assert eng.state == "running"
    assert_oracle(name, STD_PROMPTS, outs, STD_NEW)
    d = r.describe()
    assert len(d["capture_failures"]) == 2 and d["eager_fallback_steps"] >= 2 and d["captures"] >= 2
    assert eng.stats()["run"]["cuda_graph_capture_failures"] == 2
    failed = [e for e in eng.events.events("cuda_graph") if e.action == "capture_failed"]
    assert len(failed) == 2
    assert all("operation not permitted when stream is capturing" in e.error and str(e.key) in e.error
               for e in failed)
    assert {e.key for e in failed} == set(r.graphs.failures)


def test_sync_debug_covers_every_step_but_captures(monkeypatch):
    # CBNB_SYNC_DEBUG=error: each step's queueing runs under set_sync_debug_mode (a no-op on CPU, so spied here),
    # except a step that captures a graph (capturing synchronises by design).
    import contextlib

    from cbnb.runner.cuda import cuda_runner as cr

    modes = []

    @contextlib.contextmanager
    def spy(mode):
        modes.append(mode)
        yield

    monkeypatch.setattr(cr, "sync_debug", spy)
    monkeypatch.setenv("CBNB_SYNC_DEBUG", "error")
    cfg = config(page_size=16, max_batch_tokens=32, q_padding_interval_size=8, kv_padding_interval_size=48)
    eng, r, outs = run(tiny_model("tiny:llama"), cfg, n=8, sampling=dict(do_sample=True, seed=3))
    assert all(o.state == RequestState.FINISHED for o in outs)
    assert modes.count(None) == r.graphs.captures > 0
    assert modes.count("error") == len(modes) - r.graphs.captures > 0


def test_graph_support_rules():
    assert gr.graph_support("cpu", "cuda", "triton")[0] is False
    ok, why = gr.graph_support("cuda", "cuda", "torch")
    assert not ok and "host" in why
    assert gr.graph_support("cuda", "cuda", "triton") == (True, "")
    assert gr.graph_support("cpu", "fake", "torch") == (True, "")


def test_runner_disables_graphs_and_async_where_unsupported():
    model = tiny_model("tiny:llama")
    eng = cbnb.Engine(model, config=config(page_size=16, num_blocks=32))
    r = CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, attention="torch")
    r.configure(eng.config)  # resolved for CPU: graphs off, async off
    assert (r.graph_varlen, r.graph_decode, r.async_mode) == (False, False, False)
    r.configure(eng.config, use_cuda_graph=False, use_async_batching=True)
    assert not r.async_mode and "requires CUDA graphs" in r.describe()["async_reason"]
    r.configure(eng.config, use_cuda_graph=(False, True), use_async_batching=True)
    assert (r.graph_varlen, r.graph_decode, r.async_mode, len(r.pairs)) == (False, True, True, 2)
    with pytest.raises(ValueError):
        CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, backend="cuda")  # real graphs need a CUDA store


def test_factory_picks_cuda_runner_on_cuda_store(monkeypatch):
    model = tiny_model("tiny:llama")
    eng = cbnb.Engine(model, config=config(page_size=16, num_blocks=32))
    assert type(eng.runner) is ModelRunner  # CPU store: the CPU path
    assert runner_kind(torch.device("cuda")) == "cuda" and runner_kind("cpu") == "cpu"
    monkeypatch.setenv("CBNB_CUDA_RUNNER", "0")
    assert runner_kind("cuda") == "cpu"
    monkeypatch.setenv("CBNB_CUDA_RUNNER", "fake")
    assert runner_kind("cpu") == "cuda"
    r = make_runner(model, eng.cache.geometry(), eng.store, attention="torch")  # the CUDA runner on CPU: fake graphs
    assert type(r) is CudaModelRunner and r.backend_kind == "fake"


# ------------------------------------------------------------------------------------------------ engine == generate
VARIANTS = [("tiny:gemma3", False, False)] + [(m, True, False) for m in ("tiny:llama", "tiny:gemma3")] + [
    (m, True, True) for m in ("tiny:llama", "tiny:gemma3", "tiny:mistral", "tiny:qwen2")]


@pytest.mark.parametrize("name,graphs,async_", VARIANTS,
                         ids=[f"{m[5:]}-{'graphs' if g else 'eager'}{'-async' if a else ''}" for m, g, a in VARIANTS])
def test_engine_matches_generate(name, graphs, async_):
    # Chunked prefill (32-token budget), sliding windows crossed in prompt and generation, small padding intervals
    # so that several graph shapes are captured and most replays are padded.
    cfg = config(page_size=16, max_batch_tokens=32, q_padding_interval_size=8, kv_padding_interval_size=48)
    eng, r, outs = run(tiny_model(name), cfg, graphs=graphs, async_=async_)
    assert_oracle(name, STD_PROMPTS, outs, STD_NEW)
    d = r.describe()
    if graphs:
        assert d["captures"] >= 3 and d["replays"] > d["captures"]
        kinds = {k[1] for k in r.graphs.keys_captured}
        assert kinds == {"decode", "varlen"}
        run_stats = eng.stats()["run"]
        assert run_stats["cuda_graph_captures"] == d["captures"]
        assert run_stats["cuda_graph_replays"] == d["replays"]
        assert len(eng.events.events("cuda_graph")) == d["captures"]
    else:
        assert d["captures"] == 0
    if async_:
        assert d["carried_tokens"] > 0 and {k[0] for k in r.graphs.keys_captured} == {0, 1}
    else:
        assert d["carried_tokens"] == 0


def test_prefix_sharing_graphs_async():
    name = "tiny:qwen3"
    common = random_prompts([48], seed=11)[0]
    prompts = [common + t for t in random_prompts([3, 9, 16, 21], seed=12)]
    eng, r = gpu_engine(tiny_model(name), config(page_size=16, q_padding_interval_size=16,
                                                 kv_padding_interval_size=64))
    with eng:
        first = eng.generate(prompts[:1], max_new_tokens=12, eos_token_id=-1, timeout=120)
        rest = results(submit_together(eng, prompts[1:], 12))
    assert_oracle(name, prompts, first + rest, 12)
    assert all(o.prefix_cached_tokens >= 48 for o in rest)


@pytest.mark.parametrize("async_", [False, True], ids=["sync-loop", "async-loop"])
def test_token_times_reach_outputs_and_driver_records(async_):
    """Per-token times go from the loop's apply (the sync loop, or the async one collecting step N after launching
    N+1) through the handle's lazily built output to `RequestOutput.token_times` and the driver's records."""
    from cbnb.lab import traffic as tr
    from cbnb.lab.tuning import run_workload
    from cbnb.lab.workloads import synthetic

    name = "tiny:llama"
    cfg = config(page_size=16, max_batch_tokens=32, q_padding_interval_size=8, kv_padding_interval_size=48)
    wl = synthetic("t", 4, tr.Poisson(50.0), tr.Uniform(4, 30), tr.Uniform(3, 8), vocab_size=512, seed=2)
    eng, r = gpu_engine(tiny_model(name), cfg, async_=async_)
    with eng:
        outs = results(submit_together(eng, STD_PROMPTS[:4], [5, 9, 3, 12]))
        run = run_workload(eng, wl, timeout=120, log=False)
    assert r.async_mode == async_ and (r.describe()["carried_tokens"] > 0) == async_
    for o, n in zip(outs, [5, 9, 3, 12]):
        t, tm = o.token_times, o.timings
        assert len(o.token_ids) == len(t) == n
        assert all(a < b for a, b in zip(t, t[1:]))  # one token per step, each step applied after the last
        assert tm.scheduled <= t[0] == tm.first_token and t[-1] <= tm.finished
    oracle = oracle_for(name)
    for rec, prompt, n in zip(run.records, wl.prompts, wl.max_new_tokens):
        assert rec.token_ids == oracle(prompt, n) and len(rec.token_times_s) == n
        assert rec.first_token_s == rec.token_times_s[0] and len(rec.itl_s) == n - 1 and min(rec.itl_s) > 0
    assert run.metrics["itl_s_p50"] > 0


# ------------------------------------------------------------------------------------------------ padding
def test_padded_step_writes_only_real_slots_and_trash():
    model = tiny_model("tiny:gemma3")  # two layer groups (sliding ring + full) sharing the pool's bytes
    cfg = config(page_size=8, num_blocks=48, max_batch_tokens=64, q_padding_interval_size=32,
                 kv_padding_interval_size=64)
    eng, r = gpu_engine(model, cfg, async_=False)
    prompts = random_prompts([5, 21, 9], seed=3)
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts)]
    r.activate()
    try:
        for q in reqs:
            eng.core.add(q)
        for step in range(3):
            work = eng.core.schedule()
            for g, alloc in enumerate(eng.cache.allocators):  # poison the trash: padded rows must overwrite it
                bpb = eng.layout.bytes_per_block(g)
                eng.store.buffer[alloc.write_padding_block * bpb:(alloc.write_padding_block + 1) * bpb] = 0x7F
            before = eng.store.buffer.clone()
            res = r.execute(work)
            changed = (eng.store.buffer != before).nonzero().flatten()
            allowed = torch.zeros_like(eng.store.buffer, dtype=torch.bool)
            trash = torch.zeros_like(allowed)
            for g, alloc in enumerate(eng.cache.allocators):
                bpb = eng.layout.bytes_per_block(g)
                for q in reqs:
                    for b in alloc.tables.get(q.request_id, []):
                        allowed[b * bpb:(b + 1) * bpb] = True
                w = alloc.write_padding_block
                trash[w * bpb:(w + 1) * bpb] = True
                assert alloc.read_padding_block == 0
            assert (allowed | trash)[changed].all(), step  # nothing outside the requests' blocks and the trash
            assert not (changed < eng.layout.bytes_per_sector).any()  # the read-padding sector is never written
            if step == 0:  # 35 real rows padded to 64 (a capture)
                assert res.graph_counts == (1, 1, 0)
            if step == 2:  # 3 decodes padded to 4, a replay of the graph captured at step 1: the padded row wrote
                assert res.graph_counts == (0, 1, 0)  # its K/V to the trash
                assert trash[changed].any()
            eng.core.apply(work, res.tokens)
    finally:
        r.deactivate()


@pytest.mark.parametrize("q_int,kv_int", [(8, 16), (64, 512), (1, 16)])
def test_padding_never_changes_outputs(q_int, kv_int):
    name = "tiny:mistral"
    cfg = config(page_size=8, max_batch_tokens=48, q_padding_interval_size=q_int, kv_padding_interval_size=kv_int)
    _, _, eager = run(tiny_model(name), cfg, graphs=False, async_=False, n=12)
    _, r, padded = run(tiny_model(name), cfg, graphs=True, async_=False, n=12)
    assert [o.token_ids for o in eager] == [o.token_ids for o in padded]
    assert_oracle(name, STD_PROMPTS, padded, 12)


# ------------------------------------------------------------------------------------------------ async == sync
def _tokens(outs):
    return [(o.state.name, o.token_ids) for o in outs]


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
@pytest.mark.parametrize("mode", ["swap", "soft_reset", "chunked"])
def test_async_equals_sync_under_pressure(name, mode):
    base = dict(page_size=8, max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=64)
    if mode == "swap":
        base.update(num_blocks=12, cpu_offload_space=0.001)
    elif mode == "soft_reset":
        base.update(num_blocks=12, cpu_offload_space=0)
    else:
        base.update(max_batch_tokens=24)
    cfg = config(**base)
    _, _, sync = run(tiny_model(name), cfg, async_=False)
    _, r, asy = run(tiny_model(name), cfg, async_=True)
    assert _tokens(sync) == _tokens(asy)
    assert_oracle(name, STD_PROMPTS, asy, STD_NEW)
    if mode == "swap":
        assert sum(o.num_offloads for o in asy) > 0
    elif mode == "soft_reset":
        assert sum(o.num_soft_resets for o in asy) > 0
    assert r.carried > 0


def test_async_equals_sync_eos_mixed_lengths_and_seeded_sampling():
    name = "tiny:llama"
    oracle = oracle_for(name)
    eos = oracle(STD_PROMPTS[0], 6)[3]  # request 0 stops at its 4th token; others may stop on it too
    cfg = config(page_size=16, max_batch_tokens=48, q_padding_interval_size=16, kv_padding_interval_size=64)
    ns = [24, 1, 9, 24, 2, 17]
    _, _, s1 = run(tiny_model(name), cfg, n=ns, async_=False, sampling=dict(eos_token_id=eos))
    _, _, a1 = run(tiny_model(name), cfg, n=ns, async_=True, sampling=dict(eos_token_id=eos))
    assert _tokens(s1) == _tokens(a1)
    assert a1[0].finish_reason == "eos" and len(a1[0].token_ids) == 4
    samp = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    _, _, s2 = run(tiny_model(name), cfg, n=12, async_=False, sampling=samp)
    _, _, a2 = run(tiny_model(name), cfg, n=12, async_=True, sampling=samp)
    assert _tokens(s2) == _tokens(a2)
    _, _, g2 = run(tiny_model(name), cfg, n=12, graphs=False, async_=False, sampling=samp)
    assert _tokens(g2) == _tokens(a2)  # graphs or not: the same sampled tokens


def test_async_cancel_mid_run():
    name = "tiny:gemma3"
    oracle = oracle_for(name)
    cfg = config(page_size=16, max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=64)
    eng, r = gpu_engine(tiny_model(name), cfg)
    orig = r.launch

    def launch(work):
        for s in work.plan.scheduled:  # cancel request 2 while its 5th token is in flight
            if s.request.prompt_ids == STD_PROMPTS[2] and s.samples and len(s.request.output_ids) == 4:
                eng.cancel(s.request_id)
        return orig(work)

    r.launch = launch
    with eng:
        outs = results(submit_together(eng, STD_PROMPTS, STD_NEW))
    assert outs[2].state == RequestState.CANCELLED
    assert 4 <= len(outs[2].token_ids) < STD_NEW
    assert outs[2].token_ids == oracle(STD_PROMPTS[2], len(outs[2].token_ids))
    others = [i for i in range(len(STD_PROMPTS)) if i != 2]
    assert_oracle(name, [STD_PROMPTS[i] for i in others], [outs[i] for i in others], STD_NEW)
    assert_cache_empty(eng)


def test_async_stop_drains_in_flight_step():
    name = "tiny:llama"
    eng, r = gpu_engine(tiny_model(name), config(page_size=16, q_padding_interval_size=16,
                                                 kv_padding_interval_size=64))
    eng.start()
    hs = [eng.submit(p, max_new_tokens=200, eos_token_id=-1) for p in STD_PROMPTS[:3]]
    first = next(iter(hs[0]))  # at least one token streamed: steps are in flight
    assert first.token_ids
    eng.stop(drain=False, timeout=60)
    outs = [h.result(timeout=60) for h in hs]
    oracle = oracle_for(name)
    for p, o in zip(STD_PROMPTS[:3], outs):
        assert o.state == RequestState.CANCELLED
        assert o.token_ids == oracle(p, len(o.token_ids))  # the drained step's tokens were applied correctly
    assert_cache_empty(eng)


# ------------------------------------------------------------------------------------------------ Triton path
@pytest.mark.skipif(not ta.HAS_TRITON, reason=f"triton is not importable: {ta.TRITON_ERROR}")
def test_engine_through_triton_kernels():
    # The whole GPU path with the real kernels (interpreted on CPU): graphs, async, a hybrid sliding model with
    # chunked prefill. Small shapes: the interpreter runs every program in Python.
    name = "tiny:gemma3"
    prompts = [STD_PROMPTS[2], STD_PROMPTS[3]]  # 17 and 30 tokens: past the 16-token window
    cfg = config(page_size=16, max_batch_tokens=24, max_requests_per_batch=2, q_padding_interval_size=8,
                 kv_padding_interval_size=64)
    eng, r, outs = run(tiny_model(name), cfg, prompts, 8, attention="triton", num_sms=1)
    assert_oracle(name, prompts, outs, 8)
    assert r.describe()["attention"] == "triton" and r.carried > 0


def test_host_metadata_matches_cpu_batch_semantics():
    # The packed metadata of one mixed step, decoded back: ids, positions, slots and tables as the allocators say.
    model = tiny_model("tiny:mistral")
    cfg = config(page_size=8, max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=32)
    eng, r = gpu_engine(model, cfg, async_=False)
    prompts = random_prompts([5, 20], seed=9)
    for i, p in enumerate(prompts):
        eng.core.add(Request(f"m{i}", p, SamplingParams(max_new_tokens=3)))
    work = eng.core.schedule()
    pair = r.pairs[0]
    shape, lay, rows, _ = r._prepare(pair, work.plan.scheduled, work.kv)
    buf = pair.host_np
    assert shape.padded and shape.num_tokens == 32 and rows == {"m0": 0, "m1": 1}
    ids = lay.view(buf, "ids")
    assert ids[:25].tolist() == prompts[0] + prompts[1] and (ids[25:] == 0).all()
    assert lay.view(buf, "pos")[:25].tolist() == list(range(5)) + list(range(20))
    alloc = eng.cache.allocators[0]
    slots = lay.view(buf, "slots0")
    want = [s if s >= 0 else r.trash[0] for s in alloc.write_slots("m1", 0, 20)]
    assert slots[5:25].tolist() == want and (slots[25:] == r.trash[0]).all()
    assert lay.view(buf, "logits_idx")[:2].tolist() == [4, 24]
    assert lay.view(buf, "q_len")[:3].tolist() == [5, 20, 0]
    tab = lay.view(buf, "table0")
    assert tab[1, :len(alloc.tables["m1"])].tolist() == alloc.tables["m1"]
    assert np.array_equal(lay.view(buf, "tile_seq")[:3], [0, 1, -1])


def test_precapture_presets_then_serving_hits_them():
    name = "tiny:llama"
    cfg = config(page_size=16, num_blocks=64, max_batch_tokens=32, max_requests_per_batch=8,
                 q_padding_interval_size=8, kv_padding_interval_size=64)
    eng = cbnb.Engine(tiny_model(name), config=cfg)
    r = CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, attention="torch")
    r.precapture = True
    before = eng.store.buffer.clone()
    r.configure(eng.config, use_cuda_graph=True, use_async_batching=True)
    presets = [s.key for s in r.preset_shapes()]
    assert presets == [("decode", n, 64) for n in (1, 2, 4, 8)] + [("varlen", 32, 64)]
    assert r.precaptured == 2 * len(presets) and r.graphs.captures == r.precaptured
    assert torch.equal(eng.store.buffer[eng.layout.bytes_per_sector * 2:], before[eng.layout.bytes_per_sector * 2:])
    eng.runner = r
    prompts = STD_PROMPTS[:4]
    with eng:
        outs = results(submit_together(eng, prompts, 8))
    assert_oracle(name, prompts, outs, 8)
    stats = eng.stats()["run"]
    assert stats["cuda_graph_captures"] == r.graphs.captures  # start-up captures reported with the first step
    assert r.graphs.captures - r.precaptured <= 2  # decode steps hit the presets (only 32-token-or-less varlen keys)


def test_async_reconfigure_mid_run_drains_then_rebuilds():
    name = "tiny:llama"
    cfg = config(page_size=16, q_padding_interval_size=16, kv_padding_interval_size=64)
    eng, r = gpu_engine(tiny_model(name), cfg)
    eng.start()
    hs = [eng.submit(p, max_new_tokens=STD_NEW, eos_token_id=-1) for p in STD_PROMPTS[:4]]
    next(iter(hs[0]))  # generation under way, a step in flight
    eng.reconfigure(config(page_size=8, max_batch_tokens=40))  # a plain runner from here on (CPU store)
    outs = [h.result(timeout=120) for h in hs]
    eng.stop()
    assert_oracle(name, STD_PROMPTS[:4], outs, STD_NEW)
    assert type(eng.runner) is ModelRunner


def test_async_failed_launch_fails_only_its_batch():
    name = "tiny:gemma3"
    cfg = config(page_size=16, max_batch_tokens=32, max_requests_per_batch=2, q_padding_interval_size=16,
                 kv_padding_interval_size=64)
    eng, r = gpu_engine(tiny_model(name), cfg)
    orig = r.launch
    state = {"fired": False}

    def launch(work):  # fail the step in which request 5 decodes its 3rd token
        for s in work.plan.scheduled:
            if s.request.prompt_ids == STD_PROMPTS[5] and len(s.request.output_ids) >= 2 and not state["fired"]:
                state["fired"] = True
                raise RuntimeError("injected device fault")
        return orig(work)

    r.launch = launch
    with eng:
        outs = results(submit_together(eng, STD_PROMPTS, STD_NEW))
    assert state["fired"]
    failed = [i for i, o in enumerate(outs) if o.state == RequestState.FAILED]
    assert 5 in failed and all("injected device fault" in outs[i].error for i in failed)
    ok = [i for i in range(len(outs)) if i not in failed]
    assert ok, "requests outside the failed batch must go on"
    assert_oracle(name, [STD_PROMPTS[i] for i in ok], [outs[i] for i in ok], STD_NEW)
    assert_cache_empty(eng)


def test_async_equals_sync_unseeded_sampling_with_engine_seed():
    # Requests without their own seed draw from the engine-wide generator (config.seed): async batching schedules a
    # request once more after its last token is in flight; that step must not draw, or every later sample shifts.
    name = "tiny:llama"
    cfg = config(page_size=16, max_batch_tokens=48, q_padding_interval_size=16, kv_padding_interval_size=64, seed=7)
    samp = dict(do_sample=True, temperature=0.9)
    ns = [3, 12, 5, 12, 8, 2]
    _, _, s = run(tiny_model(name), cfg, n=ns, async_=False, sampling=samp)
    _, _, a = run(tiny_model(name), cfg, n=ns, async_=True, sampling=samp)
    assert _tokens(s) == _tokens(a)
