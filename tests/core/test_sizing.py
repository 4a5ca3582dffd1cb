"""Cache sizing (`cbnb.core.cache.sizing`): the memory split, and the CUDA-graph memory the cache must leave room
for."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # set before Triton is imported (cuda_runner imports the kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cbnb  # noqa: E402
from cbnb.core.cache.layout import layout_for, model_kv_spec  # noqa: E402
from cbnb.core.cache.sizing import GiB, graph_bytes, plan_cache  # noqa: E402
from cbnb.engine.models import shape_config  # noqa: E402
from cbnb.runner.cuda.cuda_runner import CudaModelRunner  # noqa: E402

from helpers_engine import config, tiny_model  # noqa: E402


def qwen3_spec() -> dict:
    cfg = shape_config("shape:qwen3-0.6b")
    spec = model_kv_spec(cfg)
    spec["intermediate_size"] = cfg.intermediate_size
    return spec


def per_token_activations(spec: dict, a: int) -> int:
    return a * (3 * spec["hidden_size"] + spec["num_heads"] * spec["head_dim"]
                + 4 * spec["num_kv_heads"] * spec["head_dim"] + 3 * spec["intermediate_size"])


def test_graph_memory_of_the_presets_for_qwen3():
    # bf16 Qwen3-0.6B with the CUDA presets (8192 batch tokens, 1024 requests, async: 2 IO pairs): a static
    # [1024, vocab] logits buffer per pair, plus the graph pool's activations of the largest (varlen) graph and its
    # transient logits.
    spec = qwen3_spec()
    assert spec["vocab_size"] == 151936
    got = graph_bytes(spec, 2, max_batch_tokens=8192, max_requests_per_batch=1024, cuda_graphs=(True, True),
                      io_pairs=2)
    static = 2 * 1024 * 151936 * 2
    pool = 8192 * per_token_activations(spec, 2) + 1024 * 151936 * 2
    assert got == static + pool
    assert 1.1e9 < got < 1.4e9
    # decode graphs only: the pool holds at most max_requests_per_batch tokens of activations
    dec = graph_bytes(spec, 2, max_batch_tokens=8192, max_requests_per_batch=1024, cuda_graphs=(False, True),
                      io_pairs=1)
    assert dec == 2 * 1024 * 151936 * 2 + 1024 * per_token_activations(spec, 2)
    assert graph_bytes(spec, 2, max_batch_tokens=8192, max_requests_per_batch=1024, cuda_graphs=(False, False),
                       io_pairs=2) == 0


def test_cache_sizing_leaves_room_for_graphs():
    spec = qwen3_spec()
    lay = layout_for(spec, 2, 256)
    kw = dict(max_batch_tokens=8192, max_requests_per_batch=1024, max_memory_percent=0.9, free_bytes=24 * GiB)
    eager = plan_cache(lay, spec, **kw)
    graphs = plan_cache(lay, spec, **kw, cuda_graphs=(True, True), io_pairs=2)
    assert eager.graph_bytes == 0 and eager.split()["cuda_graphs"] == 0
    assert graphs.split()["cuda_graphs"] == graphs.graph_bytes > 1e9
    assert graphs.num_sectors < eager.num_sectors
    # everything the split names fits the budget (the activations term includes one layer's gathered K/V)
    used = sum(v for k, v in graphs.split().items() if k != "weights")
    assert used <= graphs.budget_bytes < used + lay.bytes_per_sector + 256 * lay.bytes_per_token_per_layer
    with pytest.raises(MemoryError, match="CUDA graphs"):
        plan_cache(lay, spec, **{**kw, "free_bytes": graphs.graph_bytes}, cuda_graphs=(True, True), io_pairs=2)


def test_runner_static_logits_match_the_sizing():
    # The CUDA runner's static per-pair logits buffers are what the sizing's static term counts.
    model = tiny_model("tiny:llama")
    eng = cbnb.Engine(model, config=config(page_size=16, num_blocks=32, max_batch_tokens=64,
                                           max_requests_per_batch=16))
    r = CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, attention="torch")
    r.configure(eng.config, use_cuda_graph=True, use_async_batching=True)
    a = eng.store.layout.itemsize
    vocab = eng._builder.spec["vocab_size"]
    held = sum(p.logits.numel() * p.logits.element_size() for p in r.pairs)
    assert held == 2 * 16 * vocab * a
    total = graph_bytes(eng._builder.spec, a, max_batch_tokens=64, max_requests_per_batch=16, cuda_graphs=(True, True),
                        io_pairs=len(r.pairs))
    assert total == held + 16 * vocab * a + 64 * per_token_activations(eng._builder.spec, a)
    r.configure(eng.config, use_cuda_graph=False, use_async_batching=False)
    assert all(p.logits is None for p in r.pairs)
    assert eng.memory_split()["cuda_graphs"] == 0  # a CPU engine sizes no graph memory


def test_engine_and_simulator_size_through_one_path(monkeypatch):
    # `Engine.plan_memory` (its builder) and `SimEngine` both call `sizing.plan_memory`: given the same free memory,
    # the same model and config, they size the same cache, CUDA-graph memory included on a GPU.
    from cbnb.engine import build
    from cbnb.core.cache.sizing import plan_memory
    from cbnb.runner.cpu import cpu_linear
    from cbnb.sim import HardwareProfile, SimEngine, load_shape

    model = tiny_model("tiny:llama")
    eng = cbnb.Engine(model, config=config(page_size=16, num_blocks=32, max_batch_tokens=64))
    b = eng._builder
    free = 3 * GiB
    monkeypatch.setattr(build, "free_memory", lambda device: free)
    calls = []
    real = build.plan_memory
    monkeypatch.setattr(build, "plan_memory", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    cfg = config(page_size=16, max_batch_tokens=64, cpu_offload_space=0)
    resolved, mp, swap = eng.plan_memory(cfg)
    # the CPU runner's packed weight copies (cbnb.runner.cpu.cpu_linear) are set aside before sizing, in both
    packed = cpu_linear.bytes_to_pack(model)
    assert packed == (load_shape(model.config, dtype="float32").linear_weight_bytes() if cpu_linear.packing() else 0)
    assert calls and calls[0]["free_bytes"] == free - packed and calls[0]["device_type"] == "cpu"
    want = plan_memory(cfg, b.spec, b.itemsize, device_type="cpu", free_bytes=free - packed,
                       weight_bytes=b.weight_bytes, host_available_bytes=0, packed_weight_bytes=packed)
    assert mp.packed_weight_bytes == packed and mp.split()["packed_weights"] == packed  # shown in the config panel
    assert (resolved, mp, swap) == (want[0], want[2], want[3])
    # The simulator on a profile whose free memory is the same gives the same plan.
    shape = load_shape(model.config, dtype="float32")
    prof = HardwareProfile(name="t", kind="cpu", runner="cpu", memory_bytes=free + shape.weight_bytes(),
                           peak_flops={"float32": 1e11}, memory_bandwidth=1e10, host_device_bandwidth=1e10,
                           step_overhead_s=1e-3, step_overhead_graph_s=1e-3, kernel_launch_s=1e-5)
    sim = SimEngine(shape, prof, cfg)
    # (the shape counts parameters, the engine also its buffers, e.g. RoPE's inv_freq: only the reported bytes differ)
    assert dataclasses.replace(sim.memory, weight_bytes=mp.weight_bytes) == mp and sim.config.num_blocks == mp.num_blocks
    # On a GPU the same path counts the graphs' memory (async batching: two IO pairs).
    gpu = plan_memory(config(page_size=16), b.spec, b.itemsize, device_type="cuda", free_bytes=free,
                      weight_bytes=0, host_available_bytes=0)[2]
    eager = plan_memory(config(page_size=16, use_cuda_graph=False), b.spec, b.itemsize, device_type="cuda",
                        free_bytes=free, weight_bytes=0, host_available_bytes=0)[2]
    assert gpu.graph_bytes > 0 == eager.graph_bytes and gpu.num_sectors < eager.num_sectors
