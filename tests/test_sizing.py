"""Cache sizing (`cbnb.cache.sizing`): the memory split, and the CUDA-graph memory the cache must leave room for."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # set before Triton is imported (cuda_runner imports the kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cbnb  # noqa: E402
from cbnb.cache.layout import layout_for, model_kv_spec  # noqa: E402
from cbnb.cache.sizing import GiB, graph_bytes, plan_cache  # noqa: E402
from cbnb.models import shape_config  # noqa: E402
from cbnb.runner.cuda_runner import CudaModelRunner  # noqa: E402

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
    r = CudaModelRunner(eng.model, eng.cache, eng.store, attention="torch")
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
