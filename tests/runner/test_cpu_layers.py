"""The CPU runner's decoder-layer forward and its C ops: the same bits as transformers where the op is exact
(rotary, residual add, K/V write), float32 rounding where not (RMSNorm, SiLU); only inside the runner's forward;
the greedy oracle with the route on and off; gone from the model once its engine stops."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import cbnb
from cbnb.runner.cpu import cpu_layers, layer_ops

from helpers_engine import STD_PROMPTS, config, oracle_for, results, submit_together, tiny_model

needs_ops = pytest.mark.skipif(not layer_ops.available(), reason="no C compiler: the layer ops are unavailable")


def _rotary_inputs(T: int, H: int, Hkv: int, D: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 3  # q and k as slices of one projection
    ang = torch.randn(T, D // 2, generator=gen) * 100
    emb = torch.cat([ang, ang], -1)
    return fused[:, :H * D], fused[:, H * D:(H + Hkv) * D], emb.cos(), emb.sin()


@needs_ops
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 9, 3, 64), (7, 4, 2, 128), (300, 9, 3, 64)])
def test_rotary_is_transformers_rotary_bit_for_bit(T, H, Hkv, D):
    # Imported here: importing transformers' model code at collection would import Triton before the GPU tests set
    # TRITON_INTERPRET.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = _rotary_inputs(T, H, Hkv, D, seed=T)
    want_q, want_k = apply_rotary_pos_emb(q.view(1, T, H, D).transpose(1, 2), k.view(1, T, Hkv, D).transpose(1, 2),
                                          cos[None], sin[None])
    got_q, got_k = layer_ops.rope_qk(q, k, cos, sin, H, Hkv)
    assert got_q.shape == (T, H, D) and got_q.is_contiguous() and got_k.shape == (T, Hkv, D)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


@needs_ops
def test_rotary_rejects_what_it_cannot_take():
    q, k, cos, sin = _rotary_inputs(3, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="rope_qk"):
        layer_ops.rope_qk(q.double(), k, cos, sin, 2, 1)
    with pytest.raises(ValueError, match="rope_qk"):
        layer_ops.rope_qk(q, k, cos, sin, 3, 1)  # q is not 3 heads of 8


@needs_ops
def test_kv_write_equals_index_copy_and_refuses_rows_out_of_range():
    rows = torch.randn(100, 12)
    slots = torch.tensor([5, 0, 17, 40], dtype=torch.int64)
    k, v = torch.randn(4, 30)[:, 3:15], torch.randn(4, 12)  # k with a row stride
    want = rows.clone()
    want.index_copy_(0, slots + 2, k)
    want.index_copy_(0, slots + 50, v)
    layer_ops.write_kv(rows, slots, 2, 50, k, v)
    assert torch.equal(rows, want)
    with pytest.raises(IndexError, match="outside the 100 cache rows"):
        layer_ops.write_kv(rows, torch.tensor([1, 60]), 0, 40, k[:2], v[:2])
    assert torch.equal(rows, want)  # nothing written


@needs_ops
@pytest.mark.parametrize("T", [1, 32, 200])
def test_rms_norm_with_the_residual_add_fused_in_matches_transformers(T):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(T)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, res = torch.randn(T, 96, generator=gen) * 5, torch.randn(T, 200, generator=gen)[:, 10:106]
    same, y = layer_ops.rms_norm(x, norm.weight.data, norm.variance_epsilon)
    assert same is x
    torch.testing.assert_close(y, norm(x), rtol=1e-5, atol=1e-5)
    s, y2 = layer_ops.rms_norm(x, norm.weight.data, norm.variance_epsilon, residual=res)
    assert torch.equal(s, res + x)  # the add is torch's, bit for bit
    torch.testing.assert_close(y2, norm(res + x), rtol=1e-5, atol=1e-5)


@needs_ops
def test_silu_mul_matches_torch_on_strided_slices_and_extreme_inputs():
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(40, 256, generator=gen) * 6
    gu[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 200.0])
    g, u = gu[:, :128], gu[:, 128:]
    got = layer_ops.silu_mul(g, u)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(g) * u, rtol=2e-6, atol=1e-6)


def _routed_layers(model: torch.nn.Module) -> int:
    return cpu_layers.routed(model)


@needs_ops
def test_route_takes_llama_layers_only_and_only_inside_the_runner_forward():
    model = tiny_model("tiny:llama")
    layers = model.model.layers
    ids = torch.tensor([[5, 9, 33, 2, 71, 8]])
    with torch.no_grad():
        want = model(ids).logits
    assert cpu_layers.route(model) == cpu_layers.route(model) == len(layers)  # idempotent
    with torch.no_grad():
        got = model(ids).logits  # no cbnb batch: transformers' own forward
    assert torch.equal(got, want)
    cpu_layers.unroute(model)
    assert _routed_layers(model) == 0 and all("forward" not in m.__dict__ for m in layers)
    assert cpu_layers.route(tiny_model("tiny:gemma3")) == 0  # q/k norms and sliding windows: not this forward


def test_the_switches_route_nothing(monkeypatch):
    model = tiny_model("tiny:llama")
    monkeypatch.setenv("CBNB_CPU_LAYERS", "0")
    assert cpu_layers.route(model) == 0
    monkeypatch.setenv("CBNB_CPU_LAYERS", "1")
    monkeypatch.setenv("CBNB_CPU_KERNELS", "0")
    assert cpu_layers.route(model) == 0 and not layer_ops.available() and _routed_layers(model) == 0


@needs_ops
def test_a_module_whose_rotary_differs_is_not_routed(monkeypatch):
    model = tiny_model("tiny:llama")
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(mod, "apply_rotary_pos_emb", lambda q, k, cos, sin, unsqueeze_dim=1: (q * cos, k * cos))
    monkeypatch.setattr(cpu_layers, "_checked", {})
    assert cpu_layers.route(model) == 0


@needs_ops
@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "torch_path"])
def test_engine_runs_the_fast_layers_keeps_the_oracle_and_unroutes_at_stop(monkeypatch, fast):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1" if fast else "0")
    calls = []
    real = layer_ops.rope_qk
    monkeypatch.setattr(layer_ops, "rope_qk", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    # Chunked prefill (16-token budget) next to decoding rows, and prefix hits on the shared prompts.
    engine = cbnb.Engine(model, None, config(page_size=4, num_blocks=64, max_batch_tokens=16)).start()
    try:
        prompts = STD_PROMPTS[:4] + [STD_PROMPTS[3][:20] + [7, 8, 9]]
        outs = results(submit_together(engine, prompts, 10))
        assert _routed_layers(model) == (len(model.model.layers) if fast else 0)
    finally:
        engine.stop()
    assert (len(calls) > 0) == fast
    for p, o in zip(prompts, outs):
        assert o.token_ids == oracle(p, 10)
    assert _routed_layers(model) == 0
