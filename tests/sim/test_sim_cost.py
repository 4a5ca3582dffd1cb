"""The cost model against hand-computed cases (every number below is worked out in the comments, not by the code),
plus the attention key count, the graph padding arithmetic and reading a real StepWork."""

from __future__ import annotations

import dataclasses

import pytest

from cbnb.core.cache.manager import CacheManager
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.engine_core import EngineCore
from cbnb.core.requests import Request, SamplingParams
from cbnb.sim import CostModel, HardwareProfile, ModelShape, StepLoad
from cbnb.sim.cost import next_pow2, pad_to_interval, sum_keys

from helpers_sim import TOY
from helpers_sim import TOY_CPU as CPU

# h 8, I 16, heads 2 / kv 1, head_dim 4, vocab 100, 2 layers, float32 (a = 4 bytes)
CFG = ContinuousBatchingConfig(page_size=8).resolve("cpu")


def test_one_decode_row_by_hand():
    # One request with 9 past tokens decodes 1 token and samples.
    c = CostModel(TOY, CPU, CFG).step(StepLoad.of([(9, 1, True)]))
    # linear: params/layer = 8*2*4 + 2*8*1*4 + 2*4*8 + 3*8*16 = 64 + 64 + 64 + 384 = 576; FLOPs 2*1*576 = 1152;
    # bytes 4*(576 + 1*(7*8 + (2*2 + 2*1)*4 + 3*16)) = 4*(576 + 128) = 2816 -> max(1.152e-6, 2.816e-6), x 2 layers
    assert c.parts["linear"] == pytest.approx(2 * 2.816e-6)
    # elementwise: (7*2 + 6)*8 + 11*(2 + 1)*4 + 5*16 = 160 + 132 + 80 = 372 elements -> 1488 B/layer, x 2 = 2976,
    # plus embedding + final norm 4*1*8*8 = 256 -> 3232 B at 2e9 B/s
    assert c.parts["elementwise"] == pytest.approx(3232 / 2e9)
    # attention/layer: keys 10; FLOPs 4*2*4*10 = 320; bytes 10*(2*1*4*4) + 1*(2*2*4*4 + 32) = 320 + 96 = 416, and
    # the 10 keys span 2 pages of 8: the CPU runner gathers them, read + write 2*1 row*2 pages*8*32 = 1024 -> 1440 B
    assert c.parts["attention"] == pytest.approx(2 * 1.44e-6)
    # LM head: FLOPs 2*1*8*100 = 1600; bytes 4*8*(100 + 1) + 4*1*100 = 3232 + 400 = 3632 -> 3.632e-6
    assert c.parts["lm_head"] == pytest.approx(3.632e-6)
    assert c.parts["sample"] == pytest.approx(12 * 100 / 1e9)  # 12 bytes per logit: gathered (r + w), argmax (r)
    assert c.parts["swap"] == 0
    compute = 2 * 2.816e-6 + 3232 / 2e9 + 2 * 1.44e-6 + 3.632e-6 + 1.2e-6
    assert c.compute_s == pytest.approx(compute)
    # launch: 2 layers * 1e-5 + (2 layers * 1 batched decode call) * 2e-6 + 8 kernels * 1e-6 = 3.2e-5
    assert c.launch_s == pytest.approx(3.2e-5)
    assert c.host_s == pytest.approx(1e-3 + 1e-4)
    assert c.total_s == pytest.approx(1.1e-3 + 3.2e-5 + compute)  # CPU runner: everything in turn
    assert not c.graph


def test_gathered_decode_rows_use_the_measured_gather_rate():
    # Two decode rows spanning 2 and 3 pages of 8: one batched call per layer; counted bytes per layer:
    # row KV 10*32 + 20*32, q/o + new KV 2*96, gathered copy padded to 3 pages: 2 * 2 rows * 3 * 8 * 32 = 3072
    # -> 320 + 640 + 192 + 3072 = 4224 bytes, at 1e8 B/s
    m = CostModel(TOY, CPU.replace(gather_bandwidth=1e8), CFG)
    c = m.step(StepLoad.of([(9, 1, True), (19, 1, True)]))
    assert c.parts["attention"] == pytest.approx(2 * 4224 / 1e8)
    assert c.launch_s == pytest.approx(2 * 1e-5 + 2 * 1 * 2e-6 + 8e-6)  # one batched call per layer


def test_decode_kernel_reads_pages_in_place_in_one_call_per_layer():
    # With a measured kernel rate (float32), decode rows of 1 page and of several are one call per layer; counted
    # bytes per layer: KV 4*32 + 10*32 + 20*32, q/o + new KV 3*96 -> 128 + 320 + 640 + 288 = 1376, no gather copy.
    prof = CPU.replace(gather_bandwidth=1e8, decode_kernel_bandwidth=2e8)
    c = CostModel(TOY, prof, CFG).step(StepLoad.of([(3, 1, True), (9, 1, True), (19, 1, True)]))
    assert c.parts["attention"] == pytest.approx(2 * 1376 / 2e8)
    assert c.launch_s == pytest.approx(2 * 1e-5 + 2 * 1 * 2e-6 + 8e-6)  # one kernel call per layer
    # A prefill chunk in the same step keeps its own path (one call, its roofline) next to the kernel call.
    both = CostModel(TOY, prof, CFG).step(StepLoad.of([(0, 4, True), (9, 1, True)]))
    assert both.launch_s == pytest.approx(2 * 1e-5 + 2 * 2 * 2e-6 + 8e-6)
    # The runner uses the kernel for float32 only: a bfloat16 shape costs the torch path.
    bf = dataclasses.replace(TOY, dtype="bfloat16")
    prof_bf = prof.replace(peak_flops={"bfloat16": 1e9})
    plain = CostModel(bf, prof_bf.replace(decode_kernel_bandwidth=None), CFG).step(StepLoad.of([(9, 1, True)]))
    kern = CostModel(bf, prof_bf, CFG).step(StepLoad.of([(9, 1, True)]))
    assert kern.parts["attention"] == plain.parts["attention"] and kern.launch_s == plain.launch_s


def test_prefill_chunks_by_hand():
    # A fresh 4-token prompt (causal, no mask) and a 3-token chunk after 6 past tokens (masked rectangle on the CPU
    # runner), neither samples; 64 swapped bytes.
    c = CostModel(TOY, CPU, CFG).step(StepLoad.of([(0, 4, False), (6, 3, False)], swap_bytes=64))
    # fresh: keys 1+2+3+4 = 10 -> FLOPs 32*10 = 320; bytes kv 4*32 + 4*96 = 512 -> 5.12e-7
    # chunk: rectangle 3 x 9 keys -> FLOPs 32*27 = 864; bytes 9*32 + 3*96 + gather 2*(2 pages*8)*32 = 288+288+1024
    #        = 1600 -> 1.6e-6 ; per layer 2.112e-6, x 2 layers
    assert c.parts["attention"] == pytest.approx(2 * (5.12e-7 + 1.6e-6))
    # linear at T = 7: FLOPs 2*7*576 = 8064; bytes 4*(576 + 7*128) = 5888 -> 8.064e-6 (compute-bound), x 2
    assert c.parts["linear"] == pytest.approx(2 * 8.064e-6)
    assert c.parts["lm_head"] == 0 and c.parts["sample"] == 0
    assert c.parts["swap"] == pytest.approx(64 / 1e8)
    # 2 prefill calls per layer
    assert c.launch_s == pytest.approx(2 * 1e-5 + 4 * 2e-6 + 8e-6)
    assert c.host_s == pytest.approx(1e-3 + 2e-4)


def test_cuda_runner_eager_graph_and_padding():
    gpu = CPU.replace(name="toy-gpu", kind="gpu", runner="cuda", layer_overhead_s=None, attention_call_s=None,
                      layer_kernels=10)
    cfg = ContinuousBatchingConfig(page_size=8, use_cuda_graph=(False, True), max_batch_tokens=64,
                                   max_requests_per_batch=8).resolve("cuda")
    m = CostModel(TOY, gpu, cfg)
    # 3 decode rows -> a decode graph padded to 4 rows: linear at T=4: FLOPs 2*4*576 = 4608;
    # bytes 4*(576 + 4*128) = 4352 -> 4.608e-6 per layer; no launch cost; graph host overhead.
    c = m.step(StepLoad.of([(5, 1, True), (7, 1, True), (20, 1, True)]))
    assert c.graph and c.launch_s == 0
    assert c.parts["linear"] == pytest.approx(2 * 4.608e-6)
    assert c.host_s == pytest.approx(5e-4 + 3e-4)
    assert c.total_s == pytest.approx(c.host_s + c.compute_s)
    assert c.device_s == pytest.approx(c.compute_s)
    # A prefill step runs eagerly (varlen graphs off): launches 2 layers * 10 kernels * 1e-6 + per layer (store +
    # prefill = 2 kernels) * 2e-6 + 8e-6 overlap the kernels: total = host + max(launch, compute).
    c = m.step(StepLoad.of([(0, 5, True)]))
    assert not c.graph
    assert c.launch_s == pytest.approx(2 * 10e-6 + 2 * 2 * 2e-6 + 8e-6)
    assert c.total_s == pytest.approx(c.host_s + max(c.launch_s, c.compute_s))


def test_sliding_window_caps_keys_and_kv_reads():
    hybrid = ModelShape("toyh", "gemma3_text", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2,
                        num_kv_heads=1, head_dim=4, vocab_size=100, dtype="float32",
                        layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    m = CostModel(hybrid, CPU, CFG)
    assert m.groups == [(1, 4), (1, None)]
    c = m.step(StepLoad.of([(9, 1, True)]))
    # sliding layer reads 4 keys (one page, attended in place): FLOPs 128, bytes 4*32 + 96 = 224; the full layer as
    # in test_one_decode_row_by_hand (1440 B with the 2-page gather)
    assert c.parts["attention"] == pytest.approx(2.24e-7 + 1.44e-6)
    # a row whose keys fit one page: no gather (7 keys: bytes 7*32 + 96 = 320 on the full layer, 4*32 + 96 sliding)
    c = m.step(StepLoad.of([(6, 1, True)]))
    assert c.parts["attention"] == pytest.approx(2.24e-7 + 3.2e-7)


def test_sum_keys_matches_brute_force():
    for window in (None, 1, 3, 8):
        for start in range(0, 12):
            for n in range(1, 12):
                want = sum(p + 1 if window is None else min(p + 1, window) for p in range(start, start + n))
                assert sum_keys(start, n, window) == want, (start, n, window)


def test_padding_is_the_cuda_runners():
    gr = pytest.importorskip("cbnb.runner.cuda.graphs")
    for n in range(0, 300, 7):
        for interval in (1, 16, 64):
            for cap in (None, 100, 512):
                assert pad_to_interval(n, interval, cap) == gr.pad_to_interval(n, interval, cap)
        for cap in (None, 8, 64):
            assert next_pow2(n, cap) == gr.next_pow2(n, cap)


def test_cost_grows_with_kv_and_batch():
    m = CostModel(TOY, CPU, CFG)
    short = m(StepLoad.of([(10, 1, True)] * 4))
    long = m(StepLoad.of([(200, 1, True)] * 4))
    more = m(StepLoad.of([(10, 1, True)] * 8))
    assert short < long and short < more
    assert m(StepLoad(())) == pytest.approx(1e-3)  # an empty step: host overhead only


def test_step_load_from_real_work():
    # Drive the real core: a request swapped out and restored shows up in swap_bytes, in bytes per block per group.
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=8, max_batch_tokens=64).resolve("cpu")
    layout = TOY.layout(4)
    core = EngineCore(cfg, CacheManager(layout, layout.sectors_for_blocks(8), swap_sectors=16))
    for i, p in enumerate((6, 5, 7)):  # 3 requests that end at 17-19 tokens (5 blocks each) in 8 blocks
        core.add(Request(f"r{i}", list(range(3, 3 + p)), SamplingParams(max_new_tokens=12, ignore_eos=True)))
    seen_swap = 0
    for _ in range(100):
        if not core.has_work:
            break
        work = core.schedule()
        load = StepLoad.from_work(work, layout)
        assert [(r.start, r.tokens, r.samples) for r in load.rows] == [
            (s.start, s.num_tokens, s.samples) for s in work.plan.scheduled]
        blocks = sum(len(gp) for _, so in work.swap_outs for gp in so.pairs) + sum(
            len(gp) for _, pairs in work.restores for gp in pairs)
        assert load.swap_bytes == blocks * layout.bytes_per_block(0)
        seen_swap += load.swap_bytes
        core.apply(work, {s.request_id: 7 for s in work.plan.scheduled if s.samples})
    assert not core.has_work and seen_swap > 0


def test_profile_validation_names_the_field():
    with pytest.raises(ValueError, match="HardwareProfile.kind"):
        CPU.replace(kind="tpu")
    with pytest.raises(ValueError, match="HardwareProfile.memory_bandwidth"):
        CPU.replace(memory_bandwidth=0)
    with pytest.raises(ValueError, match="flops_efficiency"):
        CPU.replace(flops_efficiency=1.5)
    with pytest.raises(ValueError, match="no peak FLOP/s for bfloat16"):
        CPU.peak("bfloat16")


def test_prefill_kernel_prices_a_layers_chunks_as_one_causal_call():
    # With a measured prefill kernel rate (float32, full attention), every prefill chunk of a layer is one call of
    # call_s + causal FLOPs / rate: a fresh chunk of 4 (keys 1+2+3+4 = 10) and a chunk of 3 over a past of 9 (keys
    # 10+11+12 = 33): FLOPs 4*2*4*(10 + 33) = 1376 per layer, no masked rectangle and no page gather.
    prof = CPU.replace(prefill_kernel_flops=1e8, prefill_kernel_call_s=5e-6)
    c = CostModel(TOY, prof, CFG).step(StepLoad.of([(0, 4, True), (9, 3, True)]))
    assert c.parts["attention"] == pytest.approx(2 * (5e-6 + 1376 / 1e8))
    assert c.launch_s == pytest.approx(2 * 1e-5 + 2 * 1 * 2e-6 + 8e-6)  # one call per layer, not one per chunk
    torch_path = CostModel(TOY, CPU, CFG).step(StepLoad.of([(0, 4, True), (9, 3, True)]))
    assert torch_path.launch_s == pytest.approx(2 * 1e-5 + 2 * 2 * 2e-6 + 8e-6)
    # bfloat16: the runner keeps the torch path, and so does the price.
    bf = dataclasses.replace(TOY, dtype="bfloat16")
    prof_bf = prof.replace(peak_flops={"bfloat16": 1e9})
    plain = CostModel(bf, prof_bf.replace(prefill_kernel_flops=None), CFG).step(StepLoad.of([(0, 4, True)]))
    assert CostModel(bf, prof_bf, CFG).step(StepLoad.of([(0, 4, True)])).parts["attention"] == \
        plain.parts["attention"]


def test_decode_kernel_call_cost_and_thread_imbalance():
    # TOY has 1 KV head: a lone decode row is one work item, so on 2 threads one thread does it all and the call
    # takes 2x its bytes' time at the pooled rate: per layer 2 * (10*32 + 96) = 832 counted bytes. Plus the call.
    prof = CPU.replace(decode_kernel_bandwidth=2e8, decode_kernel_call_s=3e-6, threads=2)
    one = CostModel(TOY, prof, CFG).step(StepLoad.of([(9, 1, True)]))
    assert one.parts["attention"] == pytest.approx(2 * (3e-6 + 2 * 416 / 2e8))
    # Two equal rows spread over the 2 threads: no imbalance.
    two = CostModel(TOY, prof, CFG).step(StepLoad.of([(9, 1, True), (9, 1, True)]))
    assert two.parts["attention"] == pytest.approx(2 * (3e-6 + 832 / 2e8))
    # Rows of 20 and 5 keys: LPT puts them on separate threads; the busiest holds 20*32 + 96 = 736 bytes.
    uneven = CostModel(TOY, prof, CFG).step(StepLoad.of([(19, 1, True), (4, 1, True)]))
    assert uneven.parts["attention"] == pytest.approx(2 * (3e-6 + 2 * 736 / 2e8))
    # threads=None: not modelled (the pooled bytes).
    flat = CostModel(TOY, prof.replace(threads=None), CFG).step(StepLoad.of([(9, 1, True)]))
    assert flat.parts["attention"] == pytest.approx(2 * (3e-6 + 416 / 2e8))


def test_decode_kernel_prices_a_shared_prefix_at_its_cache_hot_rate():
    # Two rows of 10 keys; the second reads 8 of them from blocks the first read (4x the cold rate): it counts
    # 10 - 8 + 8 / 4 = 4 keys, 4*32 + 96 = 224 bytes, beside the first row's 416.
    prof = CPU.replace(decode_kernel_bandwidth=2e8, decode_kernel_call_s=3e-6, decode_kernel_shared_bandwidth=8e8)
    load = StepLoad.of([(9, 1, True, 0), (9, 1, True, 8)])
    shared = CostModel(TOY, prof, CFG).step(load)
    assert shared.parts["attention"] == pytest.approx(2 * (3e-6 + 640 / 2e8))
    # Without a measured shared rate the shared keys cost as the others.
    cold = CostModel(TOY, prof.replace(decode_kernel_shared_bandwidth=None), CFG).step(load)
    assert cold.parts["attention"] == pytest.approx(2 * (3e-6 + 832 / 2e8))
    with pytest.raises(ValueError, match="decode_kernel_shared_bandwidth"):
        CPU.replace(decode_kernel_shared_bandwidth=0.0)


def test_a_chunk_with_a_past_costs_its_call_keys_and_flops_when_the_profile_measured_that_path():
    # 3 query rows over 5 past keys: keys 8, FLOPs 4 H d n keys = 4*2*4*3*8 = 768, per layer of 2.
    prof = CPU.replace(past_attention_flops=1e8, past_attention_key_s=1e-6, past_attention_call_s=5e-6)
    load = StepLoad.of([(5, 3, True)])
    got = CostModel(TOY, prof, CFG).step(load)
    assert got.groups["attention"] == pytest.approx(2 * (5e-6 + 8 * 1e-6 + 768 / 1e8))
    # A fresh chunk (no past) keeps the roofline at the attention rate; no measurement: the same for a past.
    fresh = StepLoad.of([(0, 3, True)])
    assert CostModel(TOY, prof, CFG).step(fresh).groups["attention"] == pytest.approx(
        CostModel(TOY, CPU, CFG).step(fresh).groups["attention"])
    assert CostModel(TOY, CPU, CFG).step(load).groups["attention"] != pytest.approx(got.groups["attention"])
    with pytest.raises(ValueError, match="past_attention_flops"):
        CPU.replace(past_attention_flops=0.0)
    with pytest.raises(ValueError, match="past_attention_key_s"):
        CPU.replace(past_attention_key_s=-1.0)


def test_cost_factors_scale_their_groups_and_groups_keep_the_unscaled_seconds():
    prof = CPU.replace(decode_kernel_bandwidth=2e8)
    load = StepLoad.of([(0, 4, True), (9, 1, True)])
    plain = CostModel(TOY, prof, CFG).step(load)
    f = {"compute": 2.0, "attention": 3.0, "decode_attention": 0.5, "fixed": 1.5}
    c = CostModel(TOY, prof.replace(cost_factors=f), CFG).step(load)
    assert c.groups == pytest.approx(plain.groups)
    g = plain.groups
    assert plain.total_s == pytest.approx(sum(g.values()))
    assert c.total_s == pytest.approx(sum(f[k] * g[k] for k in f) + g["swap"])
    assert c.parts["linear"] == pytest.approx(2 * plain.parts["linear"])
    assert c.host_s == pytest.approx(1.5 * plain.host_s) and c.launch_s == pytest.approx(1.5 * plain.launch_s)
    with pytest.raises(ValueError, match="cost_factors: unknown group"):
        CPU.replace(cost_factors={"gemm": 1.0})
    with pytest.raises(ValueError, match=r"cost_factors\['compute'\] must be in"):
        CPU.replace(cost_factors={"compute": 0})
    with pytest.raises(ValueError, match="HardwareProfile.threads"):
        CPU.replace(threads=0)
