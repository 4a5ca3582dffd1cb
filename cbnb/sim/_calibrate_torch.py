"""The torch measurements behind `cbnb.sim.calibrate` (imported only when torch is installed)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ._together import submitted_together
from ._calibrate_common import _ROWS, _ATT_ROWS, _median_time, _positive
from .shapes import ModelShape

METHODS = {
    "memory_bandwidth": "256 MiB tensor copy, (read + write) bytes / s",
    "host_device_bandwidth": "index_select + index_copy_ of whole KV blocks (the swap path), block bytes / s",
    "peak_flops": "the fastest GEMM rate of gemm_flops",
    "gemm_flops": "the shape's 7 decoder projections at 1..512 rows in interleaved rounds, weights cycled through "
                  "512 MiB, minus dispatch; made non-decreasing in rows",
    "attention_flops": "scaled_dot_product_attention at the shape's heads: causal chunks and decode rows",
    "elementwise_curve": "one decoder layer's RMSNorms, RoPE, SiLU * up and residual adds at 1..512 rows, L2 "
                         "flushed before each run: the bytes the cost model counts for them per second",
    "gather_bandwidth": "the CPU runner's own page gather + masked attention for 16 decode rows over 512 keys: the "
                        "bytes the cost model counts per second",
    "decode_kernel_bandwidth": "the CPU runner's compiled paged-decode kernel (cbnb.runner.cpu_kernels, float32) for "
                               "16 decode rows over 512 keys in pages of 16: the bytes the cost model counts per s",
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
        out["decode_kernel"] = _kernel_decode(s, dt, reps, log)
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
    layer_bytes = sum(k * n for k, n in projections) * s.itemsize
    budget = (128 if quick else 512) << 20
    nl = max(2, min(s.num_layers, math.ceil(budget / layer_bytes)))
    if nl * layer_bytes > 2 * budget:
        nl = max(1, budget // layer_bytes)
    weights = [[torch.randn(n, k, dtype=dt) for k, n in projections] for _ in range(int(nl))]
    flops_layer = 2 * sum(k * n for k, n in projections)
    tiny_w = torch.randn(16, 16, dtype=dt)
    tiny_x = torch.randn(1, 16, dtype=dt)
    dispatch = _median_time(lambda: [F.linear(tiny_x, tiny_w) for _ in range(200)], 3) / 200
    grid = _ROWS[::2] + (_ROWS[-1],) if quick else _ROWS
    inputs = {m: {k: torch.randn(m, k, dtype=dt) for k in {p[0] for p in projections}} for m in grid}

    def run(m: int) -> float:
        xs = inputs[m]
        t0 = time.perf_counter()
        for ws in weights:
            for (k, _), w in zip(projections, ws):
                F.linear(xs[k], w)
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
    """The elementwise ops of one eager decoder layer (RMSNorms, RoPE on q and k, SiLU * up, residual adds) at 1 .. 512
    rows, with the L2 cache flushed before each run (in a forward, the layer's weights stream through it in between);
    returns, per rows, the bytes the cost model counts for them (`elementwise_elems`) per second of their real time."""
    from .cost import elementwise_elems

    h, i, H, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    half = d // 2
    junk = torch.ones((16 << 20) // 4)
    ops = 5 * s.norms_per_layer + (10 if s.qk_norm else 0) + 14
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
            layer()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        curve.append([rows, s.itemsize * rows * elementwise_elems(s) / _positive(t - ops * op_s, t * 0.05)])
    log("elementwise " + ", ".join(f"rows={m}: {r / 1e9:.1f} GB/s" for m, r in curve))
    return curve


def _kernel_decode(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> float | None:
    """The CPU runner's compiled decode kernel (`cbnb.runner.cpu_kernels.paged_decode`, what the runner uses for
    float32 decode rows when it is available), 16 rows over 512 keys in pages of 16; the bytes the cost model counts
    for it per second (`cbnb.sim.cost.decode_kernel_bytes`). None when the kernel is unavailable or not float32."""
    from ..runner import cpu_kernels
    from .cost import decode_kernel_bytes

    if dt != torch.float32 or not (cpu_kernels.enabled() and cpu_kernels.available()):
        return None
    rows, keys, page, H, Hkv, d = 16, 512, 16, s.num_heads, s.num_kv_heads, s.head_dim
    width = keys // page
    n_blocks = rows * width + 8
    k_pages = torch.randn(n_blocks, page, Hkv, d, dtype=dt)
    v_pages = torch.randn(n_blocks, page, Hkv, d, dtype=dt)
    table = torch.randperm(n_blocks)[: rows * width].view(rows, width).contiguous()
    q = torch.randn(rows, H, d, dtype=dt)
    out = torch.empty_like(q)
    idx = torch.arange(rows, dtype=torch.long)
    lens = torch.full((rows,), keys, dtype=torch.long)
    t = _median_time(lambda: cpu_kernels.paged_decode(q, k_pages, v_pages, idx, table, lens, keys, d ** -0.5, out),
                     reps)
    rate = decode_kernel_bytes(s, [keys] * rows) / t
    log(f"decode kernel {rate / 1e9:.1f} GB/s (counted bytes)")
    return rate


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
