"""The CPU runner's oneDNN linears: only inside the runner's forward, same numbers as F.linear, off with the fast
path, and gone from the model once its engine stops."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import cbnb
from cbnb.runner import cpu_linear

from helpers_engine import STD_PROMPTS, config, oracle_for, results, submit_together, tiny_model

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN linear")


def _routed(model: torch.nn.Module) -> int:
    return sum("_cbnb_linear" in m.__dict__ for m in model.modules())


def _linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@needs_onednn
def test_routed_linear_takes_onednn_only_inside_the_block_and_matches_f_linear(monkeypatch):
    lin = torch.nn.Linear(64, 96).requires_grad_(False)
    x = torch.randn(2, 5, 64)
    want = F.linear(x, lin.weight, lin.bias)
    calls = []
    real = cpu_linear._op()
    monkeypatch.setattr(cpu_linear, "_op", lambda: lambda *a: calls.append(a[0].shape) or real(*a))
    model = torch.nn.Sequential(lin)
    assert cpu_linear.route(model) == cpu_linear.route(model) == 1  # idempotent
    torch.testing.assert_close(lin(x), want, rtol=0, atol=0)  # outside the block: F.linear itself
    assert calls == []
    with cpu_linear.onednn():
        got = lin(x)
        seen = []
        t = threading.Thread(target=lambda: seen.append(lin(x)))  # another thread is not inside the block
        t.start()
        t.join()
        empty = lin(torch.zeros(0, 64))  # no rows: F.linear
    assert calls == [(2, 5, 64)]  # one oneDNN call: this thread's; the other thread and the empty input took F.linear
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # F.linear in another thread may block its sums differently (its own thread count): close, not bitwise
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)
    assert empty.shape == (0, 96)
    cpu_linear.unroute(model)
    assert _routed(model) == 0 and "forward" not in lin.__dict__


def test_fast_path_off_routes_nothing(monkeypatch):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert cpu_linear.route(model) == 0 and _routed(model) == 0
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1")
    monkeypatch.setenv("CBNB_ONEDNN_LINEAR", "0")
    assert cpu_linear.route(model) == 0 and cpu_linear.runner_linear(torch.float32) is F.linear


@needs_onednn
@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "torch_path"])
def test_engine_routes_while_it_runs_keeps_the_oracle_and_unroutes_at_stop(monkeypatch, fast):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1" if fast else "0")
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    engine = cbnb.Engine(model, None, config(page_size=4, num_blocks=64, max_batch_tokens=32)).start()
    try:
        outs = results(submit_together(engine, STD_PROMPTS[:4], 12))
        assert _routed(model) == (_linears(model) if fast else 0)
    finally:
        engine.stop()
    for p, o in zip(STD_PROMPTS[:4], outs):
        assert o.token_ids == oracle(p, 12)
    assert _routed(model) == 0
