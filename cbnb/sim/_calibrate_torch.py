"""The torch measurements behind `cbnb.sim.calibrate` (imported only when torch is installed)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..runner import cpu_linear, layer_ops
from ..runner.cpu_linear import runner_linear
from ._together import submitted_together
from ._calibrate_common import _ROWS, _ATT_ROWS, _median_time, _positive
from .shapes import ModelShape

METHODS = {
    "memory_bandwidth": "256 MiB tensor copy, (read + write) bytes / s",
    "host_device_bandwidth": "index_select + index_copy_ of whole KV blocks (the swap path), block bytes / s",
    "peak_flops": "the fastest GEMM rate of gemm_flops",
    "gemm_flops": "the shape's 7 decoder projections (4 GEMMs where the CPU runner fuses q/k/v and gate/up) at "
                  "1..512 rows in interleaved rounds, weights cycled through 512 MiB, minus dispatch; made "
                  "non-decreasing in rows",
    "attention_flops": "scaled_dot_product_attention at the shape's heads: causal chunks and decode rows",
    "elementwise_curve": "one decoder layer's RMSNorms, RoPE, SiLU * up and residual adds at 1..512 rows (the "
                         "CPU runner's C layer ops where it uses them, cbnb.runner.cpu_layers), L2 flushed before "
                         "each run: the bytes the cost model counts for them per second",
    "gather_bandwidth": "the CPU runner's own page gather + masked attention for 16 decode rows over 512 keys: the "
                        "bytes the cost model counts per second",
    "past_attention_flops": "the CPU runner's prefill path over a past (page gather + masked attention, "
                            "cbnb.runner.attention), chunks of 16 and 64 query rows over 128 and 512 past keys: "
                            "least-squares fit of call + keys x per-key seconds + FLOPs / rate; the rate",
    "past_attention_key_s": "same fit: seconds per key of the chunk's K/V (its page gather and mask)",
    "past_attention_call_s": "same fit: the fixed seconds of one such call",
    "decode_kernel_bandwidth": "the CPU runner's compiled paged-decode kernel (cbnb.runner.cpu_kernels, float32), "
                               "cold (each layer's own pages, weights streamed between calls), 16 rows x 512 keys "
                               "and 1 row x 64 keys in pages of 16: the bytes the cost model counts per s",
    "decode_kernel_call_s": "same two points: the fixed cost of one call",
    "prefill_kernel_flops": "the CPU runner's compiled prefill kernel (cbnb.runner.cpu_kernels.paged_prefill, "
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
    from .cost import elementwise_elems

    h, i, H, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    half = d // 2
    junk = torch.ones((16 << 20) // 4)
    fast = _runner_layers(s)
    # Calls per layer: transformers' eager ops, or the runner's C layer ops (cbnb.runner.cpu_layers: two norms,
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


def _runner_layers(s: ModelShape) -> bool:
    """Whether the CPU runner runs this shape's decoder layers through its C layer ops (`cbnb.runner.cpu_layers`),
    asked of a one-layer model of the shape's type."""
    from ..runner import cpu_layers

    if s.dtype != "float32":
        return False
    m = _tiny_model(s, 1)
    try:
        return cpu_layers.route(m) > 0
    finally:
        cpu_layers.unroute(m)


def _kernel_decode(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> dict[str, float] | None:
    """The CPU runner's compiled decode kernel (`cbnb.runner.cpu_kernels.paged_decode`, what the runner uses for
    float32 decode rows when it is available), cold as in a forward: one call per layer over that layer's own pages
    (as many layers as the shape has, up to 256 MiB of pages), a layer's worth of weights streamed between calls.
    Two points, 16 rows over 512 keys and 1 row over 64 keys in pages of 16, give the bandwidth (the bytes the
    cost model counts per second, `cbnb.sim.cost.kernel_thread_bytes`) and the fixed cost of a call; a third, the
    16 rows with their first 448 keys in one shared prefix, the rate over keys another row read first (cache-hot).
    None when the kernel is unavailable or not float32."""
    from ..runner import cpu_kernels
    from .cost import kernel_thread_bytes

    if dt != torch.float32 or not (cpu_kernels.enabled() and cpu_kernels.available()):
        return None
    page, H, Hkv, d = 16, s.num_heads, s.num_kv_heads, s.head_dim
    threads = torch.get_num_threads()
    layer_w = (2 * s.hidden_size * (s.num_heads + s.num_kv_heads) * d + 3 * s.hidden_size * s.intermediate_size)
    flush = torch.empty(max(1, min(layer_w, 64 << 20 >> 2)), dtype=dt)  # a layer's weights pass through the caches

    def per_call(rows: int, keys: int, shared: int = 0) -> float:
        width = -(-keys // page)
        n_blocks = rows * width + 2
        pool_bytes = 2 * n_blocks * page * Hkv * d * 4
        layers = max(1, min(s.num_layers, (256 << 20) // pool_bytes))

        def table() -> torch.Tensor:
            t = torch.randperm(n_blocks)[: rows * width].view(rows, width).contiguous()
            t[:, : shared // page] = t[0, : shared // page]  # every row's table starts with one shared prefix
            return t

        pools = [(torch.randn(n_blocks, page, Hkv, d, dtype=dt), torch.randn(n_blocks, page, Hkv, d, dtype=dt),
                  table()) for _ in range(layers)]
        q = torch.randn(rows, H, d, dtype=dt)
        out = torch.empty_like(q)
        idx = torch.arange(rows, dtype=torch.long)
        lens = torch.full((rows,), keys, dtype=torch.long)
        samples = []
        for _ in range(reps):
            total = 0.0
            for k_pages, v_pages, table in pools:
                flush.add_(1.0)
                t0 = time.perf_counter()
                cpu_kernels.paged_decode(q, k_pages, v_pages, idx, table, lens, keys, d ** -0.5, out)
                total += time.perf_counter() - t0
            samples.append(total / layers)
        return statistics.median(samples)

    big, small = (16, 512), (1, 64)
    t_big, t_small = per_call(*big), per_call(*small)
    b_big = kernel_thread_bytes(s, [big[1]] * big[0], threads)
    b_small = kernel_thread_bytes(s, [small[1]] * small[0], threads)
    # t = call + bytes / bw through both points (bw from the difference; call never negative)
    bw = (b_big - b_small) / max(t_big - t_small, 1e-9)
    call = max(0.0, t_small - b_small / bw)
    # the same rows with a shared prefix of 448 keys and 64 keys of their own: row 0 reads the prefix from memory,
    # the other rows find it in the caches
    prefix = big[1] - 64
    t_shared = per_call(*big, shared=prefix)
    hot = (big[0] - 1) * prefix * 2 * Hkv * d * 4
    rest = t_shared - call - (b_big - hot) / bw
    hot_bw = min(16 * bw, max(bw, hot / rest)) if rest > 0 else 16 * bw  # within 1-16x the cold rate
    log(f"decode kernel {bw / 1e9:.1f} GB/s (counted bytes, cold), {call * 1e6:.1f} us per call, "
        f"{hot_bw / 1e9:.1f} GB/s over a prefix another row read")
    return {"bandwidth": bw, "call_s": call, "shared_bandwidth": hot_bw}


def _gathered_decode(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> float:
    """The CPU runner's batched decode attention (rows whose keys span several pages): its page gather
    (`cbnb.runner.attention._gather_pages`) and masked attention, 16 rows over 512 keys in pages of 16; returns the
    bytes the cost model counts for it per second."""
    from ..runner.attention import _gather_pages
    from .cost import gathered_decode_bytes

    rows, keys, page, H, Hkv, d = 16, 512, 16, s.num_heads, s.num_kv_heads, s.head_dim
    width = keys // page
    n_blocks = rows * width + 8
    k_pages = torch.randn(n_blocks, page, Hkv, d, dtype=dt)
    v_pages = torch.randn(n_blocks, page, Hkv, d, dtype=dt)
    table = torch.randperm(n_blocks)[: rows * width].view(rows, width)
    q = torch.randn(rows, H, d, dtype=dt)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)

    def run() -> None:
        kd = _gather_pages(k_pages, table, keys).transpose(1, 2)
        vd = _gather_pages(v_pages, table, keys).transpose(1, 2)
        F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)

    t = _median_time(run, reps)
    rate = gathered_decode_bytes(s, [keys] * rows, page) / t
    log(f"gathered decode attention {rate / 1e9:.1f} GB/s (counted bytes)")
    return rate


# (query rows, past keys) of the prefill-over-a-past microbenchmark: the time of such a call grows with its keys
# (the page gather and the mask) as well as with its FLOPs, so a rate by query rows alone (the causal chunks) priced
# a 40-row chunk over 512 past keys 1.5x too high (2026-12-03: 1.12 ms measured, 1.70 ms predicted).
_PAST_POINTS = ((16, 128), (64, 128), (16, 512), (64, 512))


def _fit_rate(rows: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """Least squares (relative error) of ``t = sum_j c_j x_j + flops / rate`` over measured points; `rows` hold the
    x_j and last the FLOPs, `ys` the seconds. Returns the c_j (clamped non-negative) and the rate (at most 16x the
    fastest measured FLOP/s, which also stands in when the fit gives the FLOPs no cost)."""
    import numpy as np

    a, y = np.array(rows), np.array(ys)
    coef = [max(0.0, float(c)) for c in np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)[0]]
    best = max(r[-1] / t for r, t in zip(rows, ys))
    inv = coef.pop()
    return coef, (min(1.0 / inv, 16 * best) if inv > 0 else 16 * best)


def _past_attention(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> dict[str, float]:
    """The CPU runner's prefill attention for a chunk with a past ("paged" rows of `cbnb.runner.batch`: its pages
    gathered, then masked attention): ``t = call + keys * key_s + flops / rate`` fitted by least squares over
    `_PAST_POINTS` (keys = past + chunk, flops = 4 H d n keys, the masked rectangle); returns {"flops", "key_s",
    "call_s"} (each clamped non-negative, the rate at most 16x the fastest measured)."""
    from ..runner.attention import _gather_pages, _sdpa

    H, Hkv, d, page = s.num_heads, s.num_kv_heads, s.head_dim, 16
    rows, ys = [], []
    for n, past in _PAST_POINTS:
        keys = past + n
        width = -(-keys // page)
        k_pages = torch.randn(width + 2, page, Hkv, d, dtype=dt)
        v_pages = torch.randn(width + 2, page, Hkv, d, dtype=dt)
        table = torch.randperm(width + 2)[:width].unsqueeze(0)
        q = torch.randn(n, H, d, dtype=dt).transpose(0, 1).unsqueeze(0)
        mask = torch.ones(n, keys, dtype=torch.bool).tril(past)[None, None]

        def run() -> None:
            ks = _gather_pages(k_pages, table, keys)[0].transpose(0, 1).unsqueeze(0)
            vs = _gather_pages(v_pages, table, keys)[0].transpose(0, 1).unsqueeze(0)
            _sdpa(q, ks, vs, mask, True, None)

        rows.append([1.0, float(keys), 4.0 * H * d * n * keys])
        ys.append(_median_time(run, reps))
    (call, key_s), rate = _fit_rate(rows, ys)
    log(f"prefill over a past {rate / 1e9:.1f} GFLOP/s, {key_s * 1e9:.0f} ns per key, {call * 1e6:.0f} us per call "
        f"(from {', '.join(f'{n}x{p}: {t * 1e6:.0f} us' for (n, p), t in zip(_PAST_POINTS, ys))})")
    return {"flops": rate, "key_s": key_s, "call_s": call}


#: (chunk, past) points of the prefill kernel's fit: fresh chunks and chunks with a past, as cpu-32's steps hold.
_PREFILL_POINTS = ((16, 0), (64, 0), (256, 0), (64, 256), (16, 512), (128, 128))


def _kernel_prefill(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> dict[str, float] | None:
    """The CPU runner's compiled prefill kernel (`cbnb.runner.cpu_kernels.paged_prefill`, what the runner uses for
    the prefill chunks of full-attention layers in float32): ``t = call + flops / rate`` fitted by least squares
    (relative error) over `_PREFILL_POINTS`, flops = ``4 H d`` per causal query-key pair; returns {"flops",
    "call_s"}, or None when the runner would not use the kernel."""
    from ..runner import cpu_kernels

    if dt != torch.float32 or not (cpu_kernels.prefill_enabled() and cpu_kernels.available()):
        return None
    H, Hkv, d, page = s.num_heads, s.num_kv_heads, s.head_dim, 64
    rows, ys = [], []
    for n, past in _PREFILL_POINTS:
        width = -(-(past + n) // page)
        k_pages = torch.randn(width + 2, page, Hkv, d, dtype=dt)
        v_pages = torch.randn(width + 2, page, Hkv, d, dtype=dt)
        table = torch.randperm(width + 2)[:width].unsqueeze(0)
        q, out = torch.randn(n, H, d, dtype=dt), torch.empty(n, H, d, dtype=dt)
        meta = [torch.tensor([x], dtype=torch.long) for x in (0, past, n)]
        ys.append(_median_time(lambda: cpu_kernels.paged_prefill(q, k_pages, v_pages, *meta, table, d ** -0.5, out),
                               reps))
        rows.append([1.0, 4.0 * H * d * (n * past + n * (n + 1) / 2)])
    (call,), rate = _fit_rate(rows, ys)
    log(f"prefill kernel {rate / 1e9:.1f} GFLOP/s, {call * 1e6:.0f} us per call "
        f"(from {', '.join(f'{n}x{p}: {t * 1e6:.0f} us' for (n, p), t in zip(_PREFILL_POINTS, ys))})")
    return {"flops": rate, "call_s": call}


def _tiny_model(s: ModelShape, layers: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2 if s.num_kv_heads > 1 else 1, head_dim=16, vocab_size=512,
                              max_position_embeddings=4096, tie_word_embeddings=s.tie_word_embeddings)
    if s.layer_types is not None:
        kw["layer_types"] = [s.layer_types[j % len(s.layer_types)] for j in range(layers)]
    if s.sliding_window is not None:
        kw["sliding_window"] = s.sliding_window
    try:
        cfg = AutoConfig.for_model(s.model_type, **kw)
    except (ValueError, KeyError):
        cfg = AutoConfig.for_model("llama", **{k: v for k, v in kw.items() if k not in ("layer_types",)})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.requires_grad_(False)
    return model.eval()


def _decode_step_s(model: Any, rows: int, steps: int) -> float:
    """Median seconds of a decode step of `rows` single-page requests, from the engine's own step events."""
    from ..core.config import ContinuousBatchingConfig
    from ..engine.engine import Engine

    cfg = ContinuousBatchingConfig(page_size=256, num_blocks=rows + 4, max_batch_tokens=512)
    eng = Engine(model, config=cfg)
    try:
        with submitted_together(eng, timeout=60):  # every request lands in the first loop turn
            handles = [eng.submit(list(range(10, 18)), max_new_tokens=steps + 1, eos_token_id=-1)
                       for _ in range(rows)]
        for hd in handles:
            hd.result(timeout=600)
    finally:
        eng.stop()
    plans = {e.step: e for e in eng.events.events("step_planned")}
    times = [e.t - plans[e.step].t for e in eng.events.events("step_timing")
             if e.step in plans and plans[e.step].prefill_tokens == 0 and len(plans[e.step].taken) == rows]
    times.sort()
    return times[len(times) // 2]


def _fixed_costs(s: ModelShape, quick: bool, log: Callable[..., None]) -> dict[str, float]:
    """Fit t(L, B) = step + L * layer + L * B * call + B * request over tiny models' decode steps (least squares).

    The (layers, rows) points are measured in interleaved rounds so that a noisy period hits them all alike."""
    import numpy as np

    steps = 12 if quick else 30
    rounds = 1 if quick else 2
    points = [(layers, rows) for layers in (2, 8) for rows in (1, 8, 16)]
    models = {layers: _tiny_model(s, layers) for layers in (2, 8)}
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(rounds):
        for layers, rows in points:
            samples[layers, rows].append(_decode_step_s(models[layers], rows, steps))
    t = {p: sorted(v)[len(v) // 2] for p, v in samples.items()}
    a = np.array([[1.0, L, L * B, B] for L, B in points])
    y = np.array([t[p] for p in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    base, layer, call, req = (max(0.0, float(c)) for c in coef)
    log(f"fixed: step {base * 1e3:.3f} ms, layer {layer * 1e6:.1f} us, attention call {call * 1e6:.1f} us, "
        f"request {req * 1e6:.1f} us  (from {', '.join(f'L{k[0]}xB{k[1]}={v * 1e3:.2f}ms' for k, v in t.items())})")
    # More layers or more rows never make a step cheaper: when they do, the machine was too busy to measure.
    noisy = any(t[2, b] > t[8, b] for b in (1, 8, 16)) or any(t[L, 1] > t[L, 16] for L in (2, 8))
    return {"step_s": base, "layer_s": layer, "call_s": call, "request_s": req, "noisy": noisy}


# The end-to-end runs behind `cost_factors`: (requests, prompt tokens, new tokens). A long prompt alone (a full
# 512-token chunk, then decode over ~500 keys), a few short ones (decode at 4 rows), and 12 mid-sized ones (chunks
# with a past, then decode at 12 rows). None of them is a validation workload.
_FIT_RUNS = ((1, 480, 10), (4, 40, 24), (12, 160, 16), (32, 24, 8))
# The compute factor is a curve over the step's query tokens at these rows (a forward's small GEMMs lose more to
# their neighbours than its large ones), linear in log rows between them.
_FIT_COMPUTE_ROWS = (1, 16, 512)
# Each fit run runs this many times; a step's time is its fastest (the same plan every time: all requests arrive
# before the first step).
_FIT_REPEATS = 2
_FIT_BOUNDS = (0.25, 4.0)
# Ridge toward 1: moving a factor by 1 costs as much as 10 % more error on every step where its group is at least
# 5 % of the time, so a group the runs barely determine (collinear with another) stays near its microbenchmark value.
_FIT_RIDGE = 0.01


def _shape_model(s: ModelShape, budget_bytes: int) -> tuple[Any, ModelShape]:
    """A random-weight model of the shape (float32), with fewer layers when the whole one would exceed
    `budget_bytes`; returns it and the shape it has."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    layer_bytes = max(1, (s.weight_bytes() - s.vocab_size * s.hidden_size * s.itemsize) // max(1, s.num_layers))
    layers = max(2, min(s.num_layers, budget_bytes // layer_bytes))
    types = tuple(s.layer_types[:layers]) if s.layer_types else None
    kw: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=s.hidden_size,
                              intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                              num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
                              max_position_embeddings=max(4096, s.max_position_embeddings or 0),
                              tie_word_embeddings=s.tie_word_embeddings)
    if types is not None:
        kw["layer_types"] = list(types)
    if s.sliding_window is not None:
        kw["sliding_window"] = s.sliding_window
    try:
        cfg = AutoConfig.for_model(s.model_type, **kw)
    except (ValueError, KeyError):
        cfg = AutoConfig.for_model("llama", **{k: v for k, v in kw.items() if k != "layer_types"})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, s.dtype))
    model.requires_grad_(False)
    return model.eval(), dataclasses.replace(s, num_layers=layers, layer_types=types)


def _engine_steps(model: Any, requests: int, prompt: int, new: int) -> list[tuple[float, tuple]]:
    """(measured seconds, plan rows) of every step of one cbnb.Engine run (all requests in before the first step).
    Plan rows are (start, tokens, samples, shared tokens) as `cbnb.sim.cost.StepLoad.of` takes them."""
    from ..core.config import ContinuousBatchingConfig
    from ..engine.engine import Engine

    cfg = ContinuousBatchingConfig(page_size=32, num_blocks=requests * (-(-(prompt + new) // 32)) + 8,
                                   max_batch_tokens=512)
    eng = Engine(model, config=cfg)
    try:
        with submitted_together(eng, timeout=60):
            handles = [eng.submit([10 + (7 * i + j) % 400 for j in range(prompt)], max_new_tokens=new,
                                  eos_token_id=-1) for i in range(requests)]
        for hd in handles:
            hd.result(timeout=600)
    finally:
        eng.stop()
    plans = {e.step: e for e in eng.events.events("step_planned")}
    out = []
    for e in eng.events.events("step_timing"):
        p = plans.get(e.step)
        if p is None:
            continue
        shared = p.shared_tokens or [0] * len(p.taken)
        rows = tuple((start, n, phase == "decode" or start + n >= prompt, sh)
                     for (_rid, phase, n, start, _h), sh in zip(p.taken, shared))
        out.append((e.t - p.t, rows))
    return out


def fit_factors(s: ModelShape, profile: Any, log: Callable[..., None], model: Any = None,
                budget_bytes: int = 1 << 30) -> dict[str, Any]:
    """`HardwareProfile.cost_factors` for `profile` (its microbenchmark figures, factors 1): run `_FIT_RUNS` on
    cbnb.Engine (`model`, or a random-weight model of the shape; each `_FIT_REPEATS` times, a step's fastest time
    kept) and find the factors that minimise the squared
    relative error of the cost model's step times plus a ridge toward 1, ``sum_s ((sum_g f_g t_sg - m_s) / m_s)^2 +
    sum_g _FIT_RIDGE n_g (f_g - 1)^2`` with n_g the steps where group g is at least 5 % of the step (linear; a
    factor outside `_FIT_BOUNDS` is clamped and the others refitted). Groups with no time in the
    runs keep factor 1. Returns {"factors", "steps", "error_pct_before", "error_pct_after"} (median |relative step
    error| of the fit runs with factors 1 and with the fitted ones)."""
    import numpy as np

    from .cost import CostModel, StepLoad, log_interp_weights

    if model is None:
        model, fit_shape = _shape_model(s, budget_bytes)
    else:
        fit_shape = s
    base = profile.replace(cost_factors=None)
    from ..core.config import ContinuousBatchingConfig

    cost = CostModel(fit_shape, base, ContinuousBatchingConfig(page_size=32, max_batch_tokens=512))
    names = tuple(f"compute@{r}" for r in _FIT_COMPUTE_ROWS) + ("attention", "decode_attention", "fixed")
    rows, meas = [], []
    for i, run in enumerate(_FIT_RUNS):
        steps = _engine_steps(model, *run)
        for _ in range(_FIT_REPEATS - 1):  # a neighbour only ever slows a step: keep each step's fastest repeat
            again = _engine_steps(model, *run)
            if [p for _, p in again] == [p for _, p in steps]:
                steps = [(min(m, m2), p) for (m, p), (m2, _) in zip(steps, again)]
        for j, (m, plan) in enumerate(steps):
            if (i == 0 and j == 0) or m <= 0 or not plan:
                continue  # the very first step also pays one-off warm-up
            load = StepLoad.of(plan)
            g = cost.step(load).groups
            w = log_interp_weights(list(_FIT_COMPUTE_ROWS), load.num_tokens)
            rows.append([g["compute"] * wi for wi in w] + [g[k] for k in names[len(w):]] + [g["swap"]])
            meas.append(m)
    a = np.array(rows)
    y = np.array(meas)
    free = [k for k in range(len(names)) if a[:, k].sum() > 0]
    fixed = {k: 1.0 for k in range(len(names)) if k not in free}
    lo, hi = _FIT_BOUNDS
    # per group: the steps where it is at least 5 % of the step
    lam_g = _FIT_RIDGE * np.maximum(1, (a[:, :-1] >= 0.05 * y[:, None]).sum(0))
    while True:
        cols = [k for k in free if k not in fixed]
        rhs = (y - a[:, -1] - sum(a[:, k] * v for k, v in fixed.items())) / y
        x = a[:, cols] / y[:, None]
        lam = np.diag(lam_g[cols])
        coef = np.linalg.solve(x.T @ x + lam, x.T @ rhs + lam.sum(1)) if cols else []
        out = dict(zip(cols, (float(c) for c in coef)))
        bad = {k: min(max(v, lo), hi) for k, v in out.items() if not lo <= v <= hi}
        if not bad:
            break
        worst = max(bad, key=lambda k: abs(np.log(max(out[k], 1e-9) / bad[k])))
        fixed[worst] = bad[worst]
    fitted = {names[k]: round(v, 4) for k, v in {**out, **fixed}.items()}
    f = np.array([fitted[k] for k in names] + [1.0])
    factors: dict[str, Any] = {k: fitted[k] for k in names if not k.startswith("compute@")}
    factors["compute"] = [[r, fitted[f"compute@{r}"]] for r in _FIT_COMPUTE_ROWS]
    before = float(np.median(np.abs(a[:, :-1].sum(1) + a[:, -1] - y) / y))
    after = float(np.median(np.abs(a @ f - y) / y))
    log("cost factors " + ", ".join(f"{k} {v:.2f}" for k, v in fitted.items())
        + f"  (fit runs: median step error {100 * before:.1f} % -> {100 * after:.1f} %, {len(y)} steps)")
    return {"factors": factors, "steps": len(y), "error_pct_before": round(100 * before, 1),
            "error_pct_after": round(100 * after, 1)}
