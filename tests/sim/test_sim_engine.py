"""`SimEngine` (skeleton): cache sizing with the engine's code from the profile's memory, clear errors, the virtual
clock (request times and stats in simulated seconds), the sync and async timelines, and the read API."""

from __future__ import annotations

import time

import pytest

from cbnb.core.cache.sizing import plan_cache
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.requests import RequestState
from cbnb.sim import SIM_TOKEN, HardwareProfile, SimEngine, load_profile, load_shape

GiB = 1 << 30
CPU = HardwareProfile(name="t-cpu", kind="cpu", runner="cpu", memory_bytes=4 * GiB, peak_flops={"float32": 1e11},
                      memory_bandwidth=2e10, host_device_bandwidth=1e10, step_overhead_s=1e-3,
                      step_overhead_graph_s=1e-3, kernel_launch_s=1e-5, host_memory_bytes=8 * GiB)


def test_cache_is_sized_by_the_engines_code_from_the_profile():
    sim = SimEngine("llama-3.1-8b", "h100-sxm")
    shape, prof = load_shape("llama-3.1-8b"), load_profile("h100-sxm")
    r = ContinuousBatchingConfig().resolve("cuda")
    assert sim.config.max_memory_percent == 0.9 and sim.config.max_batch_tokens == 8192  # GPU resolution
    assert sim.config.use_cuda_graph == (True, True) and sim.async_batching
    want = plan_cache(shape.layout(r.page_size), shape.kv_spec(), max_batch_tokens=r.max_batch_tokens,
                      max_requests_per_batch=r.max_requests_per_batch, max_memory_percent=r.max_memory_percent,
                      free_bytes=prof.memory_bytes - prof.reserved_bytes - shape.weight_bytes(),
                      weight_bytes=shape.weight_bytes(), cuda_graphs=(True, True), io_pairs=2)
    assert sim.memory == want and sim.config.num_blocks == want.num_blocks
    assert want.graph_bytes > 0 and sim.memory_split()["cuda_graphs"] == want.graph_bytes  # the CUDA runner's graphs
    assert sim.memory_split()["weights"] == shape.weight_bytes() == 2 * 8_030_261_248
    # More memory, more blocks; a smaller max_memory_percent, fewer.
    assert SimEngine("llama-3.1-8b", "h200").config.num_blocks > sim.config.num_blocks
    assert SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(max_memory_percent=0.5)).config.num_blocks \
        < sim.config.num_blocks


def test_what_does_not_fit_is_a_clear_error():
    with pytest.raises(MemoryError, match="weights of qwen3-32b .* do not fit profile 'l4'"):
        SimEngine("qwen3-32b", "l4")
    with pytest.raises(MemoryError, match="max_batch_tokens"):
        SimEngine("llama-3.1-8b", "l4", ContinuousBatchingConfig(max_batch_tokens=1 << 20))
    with pytest.raises(MemoryError, match="num_blocks=10000000"):
        SimEngine("llama-3.1-8b", "l4", ContinuousBatchingConfig(num_blocks=10_000_000))
    with pytest.raises(ValueError, match="unknown hardware profile"):
        SimEngine("llama-3.1-8b", "h900")
    with pytest.raises(ValueError, match="unknown model shape"):
        SimEngine("llama-9", "h100-sxm")
    with pytest.raises(ValueError, match="ContinuousBatchingConfig.page_size"):
        SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(page_size=2))
    sim = SimEngine("qwen3-0.6b", "l4")
    with pytest.raises(ValueError, match="empty prompt"):
        sim.submit([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sim.submit([151936])
    with pytest.raises(ValueError, match="max positions"):
        sim.submit([5] * 40960)
    with pytest.raises(TypeError, match="holds a bool"):
        sim.submit([True, 5])
    with pytest.raises(ValueError, match="temperature"):
        sim.submit([5, 6], 3, temperature=-1.0)
    with pytest.raises(ValueError, match="no tokenizer"):
        sim.submit("text needs a tokenizer")
    sim.submit([5, 6], 3, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        sim.submit([5, 6], 3, request_id="a")
    sim.run()
    with pytest.raises(ValueError, match="already in use"):  # also once it has ended
        sim.submit([5, 6], 3, request_id="a")


def test_sync_clock_requests_and_stats_are_in_simulated_seconds():
    sim = SimEngine(load_shape("smollm2-135m", dtype="float32"), CPU,
                    ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64))
    outs = sim.generate([[40 + i for i in range(n)] for n in (30, 70, 10)], max_new_tokens=[5, 3, 8])
    assert [o.state for o in outs] == [RequestState.FINISHED] * 3
    assert [o.token_ids for o in outs] == [[SIM_TOKEN] * 5, [SIM_TOKEN] * 3, [SIM_TOKEN] * 8]
    # The clock is the sum of the predicted step times; steps tile the timeline without gaps.
    assert sim.now == pytest.approx(sum(s.cost.total_s for s in sim.steps))
    for a, b in zip(sim.steps, sim.steps[1:]):
        assert b.start_s == pytest.approx(a.end_s)
    ends = {s.step_id: s.end_s for s in sim.steps}
    plans = sim.events.events("step_planned")
    assert [e.t for e in plans] == [s.start_s for s in sim.steps]  # events carry simulated seconds
    # Each request's first token is stamped at the end of the step that produced it (virtual seconds).
    for o in outs:
        assert o.timings.queued == 0.0
        assert o.timings.first_token in ends.values() and 0 < o.timings.first_token <= o.timings.finished <= sim.now
    st = sim.stats()
    assert st["run"]["output_tokens"] == 16 and st["run"]["requests_finished"] == 3
    assert st["run"]["span_s"] == pytest.approx(sim.now)
    assert st["run"]["ttft_s"]["max"] == pytest.approx(max(o.timings.ttft_s for o in outs))
    assert sim.sim_stats()["steps"] == len(sim.steps) == len(plans)
    assert st["run"]["time_by_phase_s"]["forward"] > 0 and st["cumulative"]["output_tokens"] == 16
    assert sim.snapshot() is not None and sim.requests_snapshot()[-1].request_id == outs[-1].request_id
    sim.reset_stats()
    assert sim.stats()["run"]["steps"] == 0


def test_cancel_and_plan_memory():
    sim = SimEngine("qwen3-0.6b", "l4", ContinuousBatchingConfig(page_size=16))
    a, b = sim.submit([5] * 40, 30).request_id, sim.submit([6] * 40, 30).request_id
    sim.run(max_steps=3)
    assert sim.cancel(a) and not sim.cancel(a) and not sim.cancel("nope")
    sim.run()
    outs = {o.request_id: o for o in sim.outputs()}
    assert outs[a].state == RequestState.CANCELLED and outs[b].state == RequestState.FINISHED
    assert len(outs[b].token_ids) == 30 and 1 <= len(outs[a].token_ids) < 30
    resolved, plan, swap = sim.plan_memory(ContinuousBatchingConfig(page_size=64))
    assert resolved.page_size == 64 and resolved.num_blocks == plan.num_blocks and swap == 0
    assert sim.config.page_size == 16  # planning allocates and changes nothing


def test_async_timeline_overlaps_host_with_device():
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=256)
    prompts = [[40 + i for i in range(100)]] * 8
    results = {}
    for mode in (False, True):
        sim = SimEngine("qwen3-0.6b", "h100-sxm", cfg, async_batching=mode)
        sim.generate(prompts, max_new_tokens=32)
        results[mode] = sim
    sync, async_ = results[False], results[True]
    assert not sync.async_batching and async_.async_batching
    # Same work; async hides host time behind the device, so it finishes sooner but not faster than the device.
    assert sum(s.cost.total_s for s in sync.steps) == pytest.approx(sync.now)
    device = sum(s.cost.device_s for s in async_.steps)
    assert device <= async_.now < sync.now
    assert async_.stats()["run"]["output_tokens"] == sync.stats()["run"]["output_tokens"] == 8 * 32


def test_swap_copies_cost_host_link_time():
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=12, max_batch_tokens=64, cpu_offload_space=0.01)
    sim = SimEngine(load_shape("smollm2-135m", dtype="float32"), CPU, cfg)
    sim.generate([[40 + j for j in range(20 + 7 * i)] for i in range(4)], max_new_tokens=40)
    swapped = [s for s in sim.steps if s.cost.parts["swap"] > 0]
    assert swapped and sim.stats()["run"]["swaps"] >= 1
    assert all(s.cost.parts["swap"] * CPU.host_device_bandwidth > 0 for s in swapped)


# ---------------------------------------------------------------------------------------------- arrivals
def small_sim(**kw) -> SimEngine:
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64)
    return SimEngine(load_shape("smollm2-135m", dtype="float32"), CPU, cfg, **kw)


def test_arrivals_wait_for_their_time_and_idle_gaps_are_simulated():
    sim = small_sim()
    a = sim.submit([40] * 20, 4, arrival_s=0.0)
    b = sim.submit([41] * 20, 4, arrival_s=5.0)  # long after a has finished
    sim.run()
    oa, ob = a.result(), b.result()
    assert oa.timings.queued == 0.0 and ob.timings.queued == 5.0
    assert oa.timings.finished < 5.0 <= ob.timings.scheduled  # b is admitted at its arrival, not before
    added = {e.request_id: e for e in sim.events.events("request_added")}
    assert added[b.request_id].t == 5.0 and added[a.request_id].t == 0.0
    assert sim.now == ob.timings.finished
    # The run's span covers the idle gap, as the real engine's does.
    assert sim.stats()["run"]["span_s"] == pytest.approx(sim.now)


def test_arrivals_out_of_order_or_in_the_past_are_refused_naming_the_field():
    sim = small_sim()
    sim.submit([40] * 8, 2, arrival_s=2.0)
    with pytest.raises(ValueError, match=r"arrival_s=1\.0 is before the previous request's arrival_s=2\.0"):
        sim.submit([40] * 8, 2, arrival_s=1.0)
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="arrival_s must be a finite number"):
            sim.submit([40] * 8, 2, arrival_s=bad)
    sim.run_until(3.0)
    assert sim.now >= 3.0
    with pytest.raises(ValueError, match=r"arrival_s=2\.5 lies in the past"):
        sim.submit([40] * 8, 2, arrival_s=2.5)
    late = sim.submit([40] * 8, 2)  # no arrival_s: it arrives now
    assert late.result().timings.queued == pytest.approx(sim.events.events("request_added")[-1].t)


def timeless_plans(sim):
    return [(e.step, e.taken, e.skipped, e.stalled) for e in sim.events.events("step_planned")]


@pytest.mark.parametrize("async_", [False, True])
def test_run_until_in_pieces_makes_the_same_decisions_as_one_run(async_):
    def build():
        sim = small_sim(async_batching=async_)
        t = 0.0
        for i in range(12):
            t += 0.003 * (i % 4)
            sim.submit([40 + i] * (10 + 7 * i), 3 + i, request_id=f"q{i}", arrival_s=t)
        return sim

    whole = build()
    whole.run()
    pieces = build()
    t = 0.0
    while pieces.sim_stats()["arrivals_pending"] or pieces.core.has_work or pieces._loop.inflight:
        t += 0.004
        pieces.run_until(t)
        assert pieces.now >= t
    assert timeless_plans(pieces) == timeless_plans(whole) and len(timeless_plans(whole)) > 10
    assert [o.token_ids for o in pieces.outputs()] == [o.token_ids for o in whole.outputs()]


def test_cancel_a_request_that_has_not_arrived():
    sim = small_sim()
    a = sim.submit([40] * 8, 3, arrival_s=0.0)
    b = sim.submit([40] * 8, 3, arrival_s=9.0)
    assert sim.cancel(b.request_id) and not sim.cancel(b.request_id)
    sim.run()
    assert b.result().state == RequestState.CANCELLED and a.result().state == RequestState.FINISHED
    assert sim.now < 9.0  # nothing left to wait for
    assert [e.state for e in sim.events.events("request_done")] == ["CANCELLED", "FINISHED"]


def test_generate_and_handles_drive_the_simulation():
    sim = small_sim()
    h = sim.submit([40] * 8, 5)
    assert not h.done()
    assert h.result().token_ids == [SIM_TOKEN] * 5  # result() ran the simulation up to this request's end
    outs = sim.generate([[41] * 9, [42] * 3], max_new_tokens=[2, 4])
    assert [len(o.token_ids) for o in outs] == [2, 4]
    deltas = list(sim.submit([43] * 4, 3))  # a handle streams like the engine's (tokens as steps apply them)
    assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finished


def test_reconfigure_keeps_unfinished_and_pending_requests():
    sim = small_sim()
    hs = [sim.submit([40 + i] * 30, 20, arrival_s=0.01 * i) for i in range(4)]
    sim.run_until(0.015)
    resolved = sim.reconfigure(ContinuousBatchingConfig(page_size=32, num_blocks=40, max_batch_tokens=128))
    assert resolved.page_size == 32 and sim.config is resolved and sim.cache.page_size == 32
    sim.run()
    assert [len(h.result().token_ids) for h in hs] == [20] * 4
    with pytest.raises(MemoryError):
        sim.reconfigure(ContinuousBatchingConfig(num_blocks=10_000_000))
    assert sim.config is resolved  # the old config stays in force


@pytest.mark.parametrize("speed", [None, 50.0])
def test_playback_thread_runs_like_the_engine(speed):
    sim = small_sim()
    # Arrival times are submitted before the thread starts: a running simulation may pass them meanwhile.
    hs = [sim.submit([40 + i] * 12, 6, arrival_s=0.02 * i) for i in range(5)]
    sim.start(speed=speed)
    try:
        assert sim.state == "running" and sim.running and sim.speed == speed
        with pytest.raises(RuntimeError, match="playback thread"):
            sim.run()
        hs.append(sim.submit([50] * 12, 6))  # arrives whenever the thread is
        outs = [h.result(timeout=30) for h in hs]
        assert all(o.state == RequestState.FINISHED and len(o.token_ids) == 6 for o in outs)
        assert sim.wait_idle(timeout=30)
        assert sim.now >= 0.08
    finally:
        sim.stop()
    assert sim.state == "stopped"
    h = sim.submit([50] * 4, 2)  # a stopped simulation keeps going caller-driven
    assert h.result().state == RequestState.FINISHED
    with pytest.raises(ValueError, match="speed must be"):
        sim.start(speed=0)


def test_playback_at_speed_waits_for_simulated_time():
    sim = small_sim()
    sim.start(speed=2.0)  # 2 simulated seconds per wall second
    try:
        t0 = time.monotonic()
        h = sim.submit([40] * 8, 2, arrival_s=0.6)
        assert h.result(timeout=30).timings.queued == 0.6
        assert time.monotonic() - t0 >= 0.25  # the arrival 0.6 simulated s away came after ~0.3 wall s
        sim.speed = None  # as fast as possible from now on
        late = sim.submit([41] * 8, 2, arrival_s=1000.0)
        assert late.result(timeout=30).state == RequestState.FINISHED and sim.now >= 1000.0
    finally:
        sim.stop()


def test_reconfigure_keeps_counting_steps_and_starts_a_run_segment():
    """The issue's reproducer: 4 requests, `reconfigure(page_size=32)`, 4 more: step ids never restart, and the
    reconfigure is a `RunStarted` marker with the changed field (as on `cbnb.Engine`)."""
    sim = SimEngine("qwen3-0.6b", "l4", ContinuousBatchingConfig(page_size=16))
    for i in range(4):
        sim.submit(list(range(100, 130 + i)), 3)
    sim.run()
    first = [e.step for e in sim.events.events("step_planned")]
    sim.reconfigure(ContinuousBatchingConfig(page_size=32))
    for i in range(4):
        sim.submit(list(range(200, 230 + i)), 3)
    sim.run()
    steps = [e.step for e in sim.events.events("step_planned")]
    assert steps[:len(first)] == first and steps == sorted(set(steps)) and len(steps) > len(first)
    (mark,) = sim.events.events("run_started")
    assert mark.cause == "reconfigure" and "page_size=32" in mark.label and mark.step == first[-1]
    assert mark.config_before["page_size"] == 16 and mark.config_after["page_size"] == 32
