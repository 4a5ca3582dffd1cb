"""The CPU runner's oneDNN linears: only inside the runner's forward, same numbers as F.linear, off with the fast
path, and gone from the model once its engine stops."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import cbnb
from cbnb.runner.cpu import cpu_linear

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
    cpu_linear.available("packed")  # its one-off check calls the op too
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


@needs_onednn
def test_one_row_takes_torchs_blas_unless_told_not_to(monkeypatch):
    """A lone request's decode step (one row) was 30-60 % slower through oneDNN than F.linear on the Xeon this was
    measured on (`cpu_linear.gemv`): one row takes F.linear, bitwise; CBNB_MKL_GEMV=0 gives it oneDNN again."""
    lin = torch.nn.Linear(64, 96).requires_grad_(False)
    one, two = torch.randn(1, 1, 64), torch.randn(1, 2, 64)
    calls = []
    real = cpu_linear._op()
    cpu_linear.available("packed")
    monkeypatch.setattr(cpu_linear, "_op", lambda: lambda *a: calls.append(a[0].shape) or real(*a))
    model = torch.nn.Sequential(lin)
    cpu_linear.route(model)
    try:
        with cpu_linear.onednn():
            got = lin(one)
            lin(two)
        assert calls == [(1, 2, 64)]
        torch.testing.assert_close(got, F.linear(one, lin.weight, lin.bias), rtol=0, atol=0)
        monkeypatch.setenv("CBNB_MKL_GEMV", "0")
        with cpu_linear.onednn():
            lin(one)
        assert calls[-1] == (1, 1, 64)
        assert cpu_linear.runner_linear(torch.float32)(one[0], lin.weight).shape == (1, 96)
        assert calls[-1] == (1, 64)  # the probes' linear follows the same switch
        monkeypatch.setenv("CBNB_MKL_GEMV", "1")
        for packed in ("1", "0"):  # with packing off too, as the engine's linears
            monkeypatch.setenv("CBNB_PACKED_LINEAR", packed)
            n = len(calls)
            cpu_linear.runner_linear(torch.float32)(one[0], lin.weight)
            assert len(calls) == n, packed
    finally:
        cpu_linear.unroute(model)


class _Attn(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 48, bias=bias)
        self.k_proj = torch.nn.Linear(32, 16, bias=bias)
        self.v_proj = torch.nn.Linear(32, 16, bias=bias)
        self.o_proj = torch.nn.Linear(48, 32, bias=False)
        self.requires_grad_(False)


needs_packing = pytest.mark.skipif(not cpu_linear.packing(), reason="this torch cannot pack oneDNN weights")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_siblings_run_as_one_packed_gemm_and_match_f_linear(monkeypatch, bias):
    att = _Attn(bias)
    x, other = torch.randn(5, 32), torch.randn(5, 32)
    want = {n: F.linear(x, getattr(att, n).weight, getattr(att, n).bias) for n in ("q_proj", "k_proj", "v_proj")}
    assert cpu_linear.fused_groups(att) == [[att.q_proj, att.k_proj, att.v_proj]]
    assert cpu_linear.bytes_to_pack(att) == 4 * (48 + 16 + 16) * 32 + 4 * 32 * 48
    assert cpu_linear.route(att) == 4
    assert cpu_linear.packed_bytes(att) == 4 * (48 + 16 + 16) * 32 + 4 * 32 * 48 and cpu_linear.bytes_to_pack(att) == 0
    calls = []
    real = cpu_linear._op()
    monkeypatch.setattr(cpu_linear, "_op", lambda: lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    with cpu_linear.onednn():
        got = {n: getattr(att, n)(x) for n in ("k_proj", "q_proj", "v_proj")}  # any member may come first
        assert calls == [(80, 32)]  # one GEMM over the three weights
        alone = att.k_proj(other)  # another input: computed alone, through the fused weight
        assert len(calls) == 2
        again = att.k_proj(x)  # k's output for x was taken already: computed anew
        assert len(calls) == 3
    assert cpu_linear._local.stash == {}  # what was not taken is dropped at the end of the block
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, F.linear(other, att.k_proj.weight, att.k_proj.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, want["k_proj"], rtol=1e-5, atol=1e-5)
    cpu_linear.unroute(att)
    assert cpu_linear.packed_bytes(att) == 0 and _routed(att) == 0


@needs_packing
def test_group_output_is_the_members_outputs_side_by_side_and_yields_to_hooks():
    att = _Attn(True)
    x = torch.randn(5, 32)
    want = torch.cat([F.linear(x, m.weight, m.bias) for m in (att.q_proj, att.k_proj, att.v_proj)], dim=-1)
    cpu_linear.route(att)
    try:
        assert cpu_linear.group_output(att.q_proj, x) is None  # outside the runner's forward
        with cpu_linear.onednn():
            got = cpu_linear.group_output(att.q_proj, x)
            assert cpu_linear.group_output(att.k_proj, x) is None  # not the group's first member
            assert cpu_linear.group_output(att.o_proj, x) is None  # in no group
            assert cpu_linear.group_output(att.q_proj, x[:1]) is None  # one row: torch's BLAS, member by member
            seen = []
            hook = att.v_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
            assert cpu_linear.group_output(att.q_proj, x) is None  # a hook must see its own call
            hook.remove()
            hook = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
            assert cpu_linear.group_output(att.q_proj, x) is None
            hook.remove()
            assert cpu_linear.group_output(att.q_proj, x) is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.shape == (5, 80)
    finally:
        cpu_linear.unroute(att)


@needs_onednn
def test_a_hook_on_a_fused_projection_still_sees_every_engine_step():
    model = tiny_model("tiny:llama")
    k_proj = model.model.layers[0].self_attn.k_proj
    calls = []
    hook = k_proj.register_forward_hook(lambda m, a, out: calls.append(tuple(out.shape)))
    engine = cbnb.Engine(model, None, config(page_size=4, num_blocks=64, max_batch_tokens=32)).start()
    try:
        outs = results(submit_together(engine, STD_PROMPTS[:2], 6))
        steps = engine.core.step_id
    finally:
        engine.stop()
        hook.remove()
    oracle = oracle_for("tiny:llama")
    assert [o.token_ids for o in outs] == [oracle(p, 6) for p in STD_PROMPTS[:2]]
    assert len(calls) >= steps > 0  # once per forward: the layer called the module, not the fused GEMM alone


@needs_packing
def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    att = _Attn(False)
    cpu_linear.route(att)
    x = torch.randn(3, 32)
    with torch.no_grad():
        att.k_proj.weight.mul_(2.0)  # in place: its version changes
        att.o_proj.weight = torch.nn.Parameter(torch.randn(32, 48), requires_grad=False)  # replaced
    with cpu_linear.onednn():
        k, o = att.k_proj(x), att.o_proj(torch.ones(3, 48))
    torch.testing.assert_close(k, F.linear(x, att.k_proj.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, F.linear(torch.ones(3, 48), att.o_proj.weight), rtol=1e-5, atol=1e-5)
    cpu_linear.unroute(att)


def test_packing_off_routes_plain_weights(monkeypatch):
    monkeypatch.setenv("CBNB_PACKED_LINEAR", "0")
    att = _Attn(False)
    assert not cpu_linear.packing() and cpu_linear.bytes_to_pack(att) == 0
    if cpu_linear.available():
        assert cpu_linear.route(att) == 4 and cpu_linear.packed_bytes(att) == 0
        with cpu_linear.onednn():
            y = att.q_proj(torch.ones(2, 32))
        torch.testing.assert_close(y, F.linear(torch.ones(2, 32), att.q_proj.weight, att.q_proj.bias),
                                   rtol=1e-5, atol=1e-5)
    cpu_linear.unroute(att)


def test_fast_path_off_routes_nothing(monkeypatch):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert cpu_linear.route(model) == 0 and _routed(model) == 0
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1")
    monkeypatch.setenv("CBNB_ONEDNN_LINEAR", "0")
    assert cpu_linear.route(model) == 0 and cpu_linear.runner_linear(torch.float32) is F.linear


@needs_onednn
@pytest.mark.parametrize("fast,packed", [(True, True), (True, False), (False, False)],
                         ids=["fast_path", "fast_path_unpacked", "torch_path"])
def test_engine_routes_while_it_runs_keeps_the_oracle_and_unroutes_at_stop(monkeypatch, fast, packed):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1" if fast else "0")
    monkeypatch.setenv("CBNB_PACKED_LINEAR", "1" if packed else "0")
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    engine = cbnb.Engine(model, None, config(page_size=4, num_blocks=64, max_batch_tokens=32)).start()
    try:
        outs = results(submit_together(engine, STD_PROMPTS[:4], 12))
        assert _routed(model) == (_linears(model) if fast else 0)
        assert (cpu_linear.packed_bytes(model) > 0) == (fast and packed and cpu_linear.packing())
        packs = [m.__dict__.get("_cbnb_pack") for m in model.modules()]
        engine.reconfigure(page_size=8)  # the model stays routed through a rebuild (nothing packed again)
        assert _routed(model) == (_linears(model) if fast else 0)
        assert all(a is b for a, b in zip(packs, [m.__dict__.get("_cbnb_pack") for m in model.modules()]))
        outs2 = results(submit_together(engine, STD_PROMPTS[:4], 12))
    finally:
        engine.stop()
    for p, o, o2 in zip(STD_PROMPTS[:4], outs, outs2):
        assert o.token_ids == o2.token_ids == oracle(p, 12)
    assert _routed(model) == 0 and cpu_linear.packed_bytes(model) == 0
