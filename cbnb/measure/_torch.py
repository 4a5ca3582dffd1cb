"""The torch measurements behind `cbnb.measure.calibrate` (imported only when torch is installed): `measure` runs
every probe; this module holds the GEMM, attention, elementwise, bandwidth and dispatch probes, `_torch_kernels`
the runner's own attention paths and kernels, `_torch_fit` the engine-level fits."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..runner.cpu import cpu_linear, layer_ops
from ..runner.cpu.cpu_linear import runner_linear
from ..sim.shapes import ModelShape
from ._common import _ATT_ROWS, _ROWS, _median_time, _positive
from ._torch_fit import _fixed_costs
from ._torch_kernels import (_gathered_decode, _kernel_decode, _kernel_prefill, _past_attention,
                             _runner_layers)

METHODS = {
    "memory_bandwidth": "256 MiB tensor copy, (read + write) bytes / s",
    "host_device_bandwidth": "index_select + index_copy_ of whole KV blocks (the swap path), block bytes / s",
    "peak_flops": "the fastest GEMM rate of gemm_flops",
    "gemm_flops": "the shape's 7 decoder projections (4 GEMMs where the CPU runner fuses q/k/v and gate/up) at "
                  "1..512 rows in interleaved rounds, weights cycled through 512 MiB, minus dispatch; made "
                  "non-decreasing in rows",
    "attention_flops": "scaled_dot_product_attention at the shape's heads: causal chunks and decode rows",
    "elementwise_curve": "one decoder layer's RMSNorms, RoPE, SiLU * up and residual adds at 1..512 rows (the "
                         "CPU runner's C layer ops where it uses them, cbnb.runner.cpu.cpu_layers), L2 flushed before "
                         "each run: the bytes the cost model counts for them per second",
    "gather_bandwidth": "the CPU runner's own page gather + masked attention for 16 decode rows over 512 keys: the "
                        "bytes the cost model counts per second",
    "past_attention_flops": "the CPU runner's prefill path over a past (page gather + masked attention, "
                            "cbnb.runner.cpu.attention), chunks of 16 and 64 query rows over 128 and 512 past keys: "
                            "least-squares fit of call + keys x per-key seconds + FLOPs / rate; the rate",
    "past_attention_key_s": "same fit: seconds per key of the chunk's K/V (its page gather and mask)",
    "past_attention_call_s": "same fit: the fixed seconds of one such call",
    "decode_kernel_bandwidth": "the CPU runner's compiled paged-decode kernel (cbnb.runner.cpu.cpu_kernels, float32), "
                               "cold (each layer's own pages, weights streamed between calls), 16 rows x 512 keys "
                               "and 1 row x 64 keys in pages of 16: the bytes the cost model counts per s",
    "decode_kernel_call_s": "same two points: the fixed cost of one call",
    "prefill_kernel_flops": "the CPU runner's compiled prefill kernel (cbnb.runner.cpu.cpu_kernels.paged_prefill, "
                            "float32), fresh chunks of 16-256 rows and chunks of 16-128 rows over 128-512 past keys: causal "
                            "FLOPs per second of a least-squares fit t = call + flops / rate",
    "prefill_kernel_call_s": "same fit: the fixed seconds of one call",
    "decode_kernel_shared_bandwidth": "the same kernel, 16 rows x 512 keys whose first 448 are one shared prefix: "
                                      "the rate over the prefix keys after the first row's",
    "cost_factors": "cbnb.Engine on a random-weight model of the shape (prefill chunks with and without a past, "
                    "decode at 1, 4, 12 and 32 rows; each run twice, a step's fastest time kept), the cost model's "
                    "groups scaled to its step times (least squares on relative error)",
    "kernel_launch_s": "one small tensor op (dispatch)",
    "step_overhead_s": "cbnb.Engine on tiny random models of the shape's architecture, least-squares fit over 2/8 "
                       "layers and 1/8/16 decode rows: the intercept (schedule, packing, sampling, update, telemetry)",
    "layer_overhead_s": "same fit: per decoder layer",
    "attention_call_s": "same fit: per attention call (one per single-page decode row and layer)",
    "request_overhead_s": "same fit: per scheduled request",
}


def measure(s: ModelShape, *, threads: int | None, quick: bool, log: Callable[..., None],
            budget_s: float = 60.0) -> dict[str, Any]:
    """All measurements; the GEMM rounds (the longest part) stop early when they use up half of `budget_s`."""
    deadline = time.perf_counter() + budget_s / 2
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[s.dtype]
        reps = 3 if quick else 7
        out: dict[str, Any] = {"backend": f"torch {torch.__version__}", "threads": torch.get_num_threads()}
        out["op_s"] = _op_cost(reps)
        out["bandwidth"], out["swap_bandwidth"] = _bandwidth(s, quick, reps)
        log(f"bandwidth {out['bandwidth'] / 1e9:.1f} GB/s, swap {out['swap_bandwidth'] / 1e9:.1f} GB/s, "
            f"op {out['op_s'] * 1e6:.2f} us")
        out["gemm"] = _gemm(s, dt, quick, log, deadline)
        out["attention"] = _attention(s, dt, quick, reps, log)
        out["elementwise"] = _elementwise(s, dt, quick, reps, out["op_s"], log)
        out["gather"] = _gathered_decode(s, dt, reps, log)
        out["past_attention"] = _past_attention(s, dt, reps, log)
        out["decode_kernel"] = _kernel_decode(s, dt, reps, log)
        out["prefill_kernel"] = _kernel_prefill(s, dt, reps, log)
        out.update(_fixed_costs(s, quick, log))
        return out
    finally:
        torch.set_num_threads(old)


def _op_cost(reps: int) -> float:
    a, b = torch.ones(8), torch.ones(8)
    n = 2000
    return _median_time(lambda: [torch.add(a, b) for _ in range(n)], reps) / n


def _bandwidth(s: ModelShape, quick: bool, reps: int) -> tuple[float, float]:
    n = (64 if quick else 256) << 20
    src = torch.ones(n // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    bw = 2 * n / _median_time(lambda: dst.copy_(src), reps)
    # The swap copy: rows of one block (all layers of a page) gathered and scattered by index.
    block = max(4096, 2 * s.num_kv_heads * s.head_dim * s.itemsize * 16 * s.num_layers)
    rows = max(8, n // 4 // block)
    pool = torch.zeros(rows, block, dtype=torch.uint8)
    host = torch.zeros(rows, block, dtype=torch.uint8)
    idx = torch.randperm(rows)
    swap = rows * block / _median_time(lambda: host.index_copy_(0, idx, pool.index_select(0, idx)), reps)
    return bw, swap


def _gemm(s: ModelShape, dt: torch.dtype, quick: bool, log: Callable[..., None],
          deadline: float = math.inf) -> list[list[float]]:
    h, i, H, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    projections = [(h, H * d), (h, Hkv * d), (h, Hkv * d), (H * d, h), (h, i), (h, i), (i, h)]
    if dt == torch.float32 and cpu_linear.packing():  # the CPU runner fuses q/k/v and gate/up (same FLOPs)
        projections = [(h, (H + 2 * Hkv) * d), (H * d, h), (h, 2 * i), (i, h)]
    layer_bytes = sum(k * n for k, n in projections) * s.itemsize
    budget = (128 if quick else 512) << 20
    nl = max(2, min(s.num_layers, math.ceil(budget / layer_bytes)))
    if nl * layer_bytes > 2 * budget:
        nl = max(1, budget // layer_bytes)
    weights = [[torch.randn(n, k, dtype=dt) for k, n in projections] for _ in range(int(nl))]
    flops_layer = 2 * sum(k * n for k, n in projections)
    tiny_w = torch.randn(16, 16, dtype=dt)
    tiny_x = torch.randn(1, 16, dtype=dt)
    linear = runner_linear(dt)  # the engine's own CPU linear (oneDNN for float32 with the fast path on)
    dispatch = _median_time(lambda: [linear(tiny_x, tiny_w) for _ in range(200)], 3) / 200
    grid = _ROWS[::2] + (_ROWS[-1],) if quick else _ROWS
    inputs = {m: {k: torch.randn(m, k, dtype=dt) for k in {p[0] for p in projections}} for m in grid}

    def run(m: int) -> float:
        xs = inputs[m]
        t0 = time.perf_counter()
        for ws in weights:
            for (k, _), w in zip(projections, ws):
                linear(xs[k], w)
        return time.perf_counter() - t0

    times: dict[int, list[float]] = {m: [] for m in grid}
    run(grid[0])  # warm-up
    for r in range(3 if quick else 5):  # interleaved rounds: a noisy moment hits every row count alike
        if r >= 2 and time.perf_counter() > deadline:
            break
        for m in grid:
            times[m].append(run(m))
    curve = []
    for m in grid:
        t = statistics.median(times[m])
        t = _positive(t - dispatch * len(projections) * nl, t * 0.1)
        curve.append([m, m * flops_layer * nl / t])
    _monotone(curve)
    log("GEMM " + ", ".join(f"rows={m}: {r / 1e9:.1f}" for m, r in curve) + " GFLOP/s")
    return curve


def _monotone(curve: list[list[float]]) -> None:
    """A rate never falls with more rows (more rows of the same GEMM never cost more per FLOP): a dip is noise."""
    for j in range(1, len(curve)):
        curve[j][1] = max(curve[j][1], curve[j - 1][1])


def _attention(s: ModelShape, dt: torch.dtype, quick: bool, reps: int, log: Callable[..., None]) -> list[list[float]]:
    H, Hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    small = torch.randn(1, 1, 1, 8, dtype=dt)
    call = _median_time(lambda: [F.scaled_dot_product_attention(small, small, small) for _ in range(100)], 3) / 100
    curve = []
    keys = 512
    q = torch.randn(1, H, 1, d, dtype=dt)
    k = torch.randn(1, Hkv, keys, d, dtype=dt)
    t = _median_time(lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True), reps)
    curve.append([1, 4 * H * d * keys / _positive(t - call, t * 0.1)])
    for n in (_ATT_ROWS[1::2] if quick else _ATT_ROWS):
        # Strided as the runner passes them: token-major [n, heads, d] viewed as [1, heads, n, d].
        q = torch.randn(n, H, d, dtype=dt).transpose(0, 1).unsqueeze(0)
        k = torch.randn(n, Hkv, d, dtype=dt).transpose(0, 1).unsqueeze(0)
        t = _median_time(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), reps)
        curve.append([n, 4 * H * d * (n * (n + 1) // 2) / _positive(t - call, t * 0.1)])
    _monotone(curve)
    log("attention " + ", ".join(f"rows={m}: {r / 1e9:.1f} GFLOP/s" for m, r in curve))
    return curve


def _elementwise(s: ModelShape, dt: torch.dtype, quick: bool, reps: int, op_s: float,
                 log: Callable[..., None]) -> list[list[float]]:
    """The elementwise ops of one eager decoder layer (RMSNorms, RoPE on q and k, SiLU * up, residual adds; through the
    runner's C layer ops where it uses them) at 1 .. 512 rows, with the L2 cache flushed before each run (in a
    forward, the layer's weights stream through it in between); returns, per rows, the bytes the cost model counts
    for them (`elementwise_elems`) per second of their real time."""
    from ..sim.cost import elementwise_elems

    h, i, H, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    half = d // 2
    junk = torch.ones((16 << 20) // 4)
    fast = _runner_layers(s)
    # Calls per layer: transformers' eager ops, or the runner's C layer ops (cbnb.runner.cpu.cpu_layers: two norms,
    # rotary, SiLU * up) and its one residual add in torch.
    ops = 5 if fast else 5 * s.norms_per_layer + (10 if s.qk_norm else 0) + 14
    curve = []
    for rows in ((1, 64, 512) if quick else (1, 16, 64, 256, 512)):
        x = torch.randn(rows, h, dtype=dt)
        w = torch.ones(h, dtype=dt)
        q, k = torch.randn(rows, H, d, dtype=dt), torch.randn(rows, Hkv, d, dtype=dt)
        cos, sin = torch.randn(rows, 1, d, dtype=dt), torch.randn(rows, 1, d, dtype=dt)
        wd = torch.ones(d, dtype=dt)
        g, u = torch.randn(rows, i, dtype=dt), torch.randn(rows, i, dtype=dt)

        def norm(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

        def rope(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

        qk = torch.randn(rows, (H + Hkv) * d, dtype=dt)
        qf, kf, cs = qk[:, :H * d], qk[:, H * d:], torch.randn(rows, d, dtype=dt)

        def fast_layer() -> None:
            _, n1 = layer_ops.rms_norm(x, w, 1e-6)
            layer_ops.rope_qk(qf, kf, cs, cs, H, Hkv)
            layer_ops.rms_norm(n1, w, 1e-6, residual=x)
            layer_ops.silu_mul(g, u)
            x + x

        def layer() -> None:
            for _ in range(s.norms_per_layer):
                norm(x, w)
            if s.qk_norm:
                norm(q, wd), norm(k, wd)
            rope(q), rope(k)
            F.silu(g) * u
            x + x, x + x

        times = []
        for _ in range(reps + 1):
            junk.mul_(1.0)  # evict the L2 cache, as the weights of a layer do
            t0 = time.perf_counter()
            (fast_layer if fast else layer)()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        curve.append([rows, s.itemsize * rows * elementwise_elems(s) / _positive(t - ops * op_s, t * 0.05)])
    log(f"elementwise ({'C layer ops' if fast else 'torch ops'}) "
        + ", ".join(f"rows={m}: {r / 1e9:.1f} GB/s" for m, r in curve))
    return curve
