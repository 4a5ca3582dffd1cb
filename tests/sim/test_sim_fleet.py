"""Fleets in the simulator: a tensor-parallel group's profile (memory and rates split over the GPUs, two ring
all-reduces per layer from the link's datasheet bandwidth) and replicas behind a router."""

from __future__ import annotations

import pytest

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab import traffic as tr
from cbnb.lab.workloads import synthetic
from cbnb.sim import CostModel, StepLoad, load_profile, load_shape
from cbnb.sim.fleet import Fleet, allreduce_s, allreduce_step_s, link_of, tensor_parallel

SHAPE = load_shape("llama-3.1-70b")
NVLINK = link_of("h100-sxm")


def test_ring_allreduce_formula():
    assert allreduce_s(1e6, 1, NVLINK) == 0.0
    assert allreduce_s(1e6, 8, NVLINK) == pytest.approx(NVLINK.latency_s + 2 * 7 / 8 * 1e6 / 450e9)
    # two per layer over tokens x hidden x 2 bytes
    assert allreduce_step_s(SHAPE, 100, 4, NVLINK) == pytest.approx(160 * allreduce_s(100 * 8192 * 2, 4, NVLINK))
    assert NVLINK.bandwidth == 450e9 and NVLINK.latency_s == 8e-6
    assert "datasheet" in NVLINK.source and "NVLink" in NVLINK.source and "assumed" in NVLINK.source


def test_a_tp_group_splits_weights_and_kv_and_pays_the_allreduces():
    one = load_profile("h100-sxm")
    tp4 = tensor_parallel(one, 4, SHAPE)
    assert tensor_parallel(one, 1, SHAPE) is one
    assert tp4.name == "h100-sxm-tp4" and tp4.memory_bytes == 4 * one.memory_bytes
    assert tp4.memory_bandwidth == 4 * one.memory_bandwidth
    assert tp4.peak_flops["bfloat16"] == 4 * one.peak_flops["bfloat16"]
    assert "NVLink 900GB/s" in tp4.sources["tensor_parallel"]
    # The step's price (CUDA graphs on, as served) is the split roofline plus the all-reduces, at the curve's token
    # counts.
    cfg = ContinuousBatchingConfig().resolve("cuda")
    split = tensor_parallel(one, 4, SHAPE, link=NVLINK.__class__("free", 1e30, 0.0, "none"))
    for tokens in (1, 64, 2048):
        load = StepLoad.of([(0, tokens, True)])
        with_ar = CostModel(SHAPE, tp4, cfg).step(load).total_s
        without = CostModel(SHAPE, split, cfg).step(load).total_s
        assert with_ar - without == pytest.approx(allreduce_step_s(SHAPE, tokens, 4, NVLINK), rel=0.02)
    # a decode step of 64 requests: TP 8 is faster than TP 2 (more bandwidth), not 4 x (all-reduces, replicated ops)
    load = StepLoad.of([(1000, 1, True)] * 64)
    t2 = CostModel(SHAPE, tensor_parallel(one, 2, SHAPE), cfg).step(load).total_s
    t8 = CostModel(SHAPE, tensor_parallel(one, 8, SHAPE), cfg).step(load).total_s
    assert t2 / 4 < t8 < t2


def test_bad_tensor_parallel_sizes_and_unknown_links_are_named():
    with pytest.raises(ValueError, match="tensor_parallel_size must divide the attention heads of llama-3.1-70b"):
        tensor_parallel("h100-sxm", 3, SHAPE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        tensor_parallel("h100-sxm", 0, SHAPE)
    import dataclasses
    custom = dataclasses.replace(load_profile("h100-sxm"), name="my-gpu")
    custom = dataclasses.replace(custom, interconnect_bandwidth=None)
    with pytest.raises(ValueError, match="profile 'my-gpu' has no interconnect_bandwidth.*pass link="):
        tensor_parallel(custom, 2, SHAPE)
    with pytest.raises(ValueError, match="router must be one of 'round_robin', 'least_loaded'"):
        Fleet(SHAPE, "h100-sxm", tensor_parallel_size=4, router="random")
    with pytest.raises(MemoryError, match="do not fit"):
        Fleet(SHAPE, "h100-sxm", tensor_parallel_size=1)


TRAFFIC = synthetic("fleet", 40, tr.Poisson(8.0), tr.LogNormal(600, 0.8, 32, 4000), tr.LogNormal(64, 0.5, 8, 200),
                    vocab_size=32000, seed=1)


@pytest.mark.parametrize("router", ["round_robin", "least_loaded"])
def test_replicas_behind_a_router_serve_every_request_whole(router):
    fleet = Fleet(SHAPE, "h100-sxm", tensor_parallel_size=4, replicas=3, router=router)
    outs = fleet.serve(TRAFFIC.prompts, TRAFFIC.max_new_tokens, TRAFFIC.arrival_s)
    assert [len(o.token_ids) for _, o in outs] == TRAFFIC.max_new_tokens
    assert fleet.gpus == 12 and len(fleet.engines) == 3
    counts = [fleet.routed.count(r) for r in range(3)]
    if router == "round_robin":
        assert fleet.routed == [i % 3 for i in range(40)]
    else:
        assert min(counts) > 0 and sum(counts) == 40
    for r, out in outs:  # each request ran on the replica it was routed to, from its arrival on
        assert out.timings.queued >= 0
    assert sum(e.stats()["run"]["requests_finished"] for e in fleet.engines) == 40
