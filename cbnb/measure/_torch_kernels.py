"""The torch probes of the CPU runner's own attention paths and compiled kernels behind `cbnb.measure.calibrate`
(imported only when torch is installed): page-gathered decode, prefill over a past, the C decode and prefill
kernels."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..sim.shapes import ModelShape
from ._common import _median_time
from ._torch_fit import _tiny_model

def _runner_layers(s: ModelShape) -> bool:
    """Whether the CPU runner runs this shape's decoder layers through its C layer ops (`cbnb.runner.cpu.cpu_layers`),
    asked of a one-layer model of the shape's type."""
    from ..runner.cpu import cpu_layers

    if s.dtype != "float32":
        return False
    m = _tiny_model(s, 1)
    try:
        return cpu_layers.route(m) > 0
    finally:
        cpu_layers.unroute(m)


def _kernel_decode(s: ModelShape, dt: torch.dtype, reps: int, log: Callable[..., None]) -> dict[str, float] | None:
    """The CPU runner's compiled decode kernel (`cbnb.runner.cpu.cpu_kernels.paged_decode`, what the runner uses for
    float32 decode rows when it is available), cold as in a forward: one call per layer over that layer's own pages
    (as many layers as the shape has, up to 256 MiB of pages), a layer's worth of weights streamed between calls.
    Two points, 16 rows over 512 keys and 1 row over 64 keys in pages of 16, give the bandwidth (the bytes the
    cost model counts per second, `cbnb.sim.cost.kernel_thread_bytes`) and the fixed cost of a call; a third, the
    16 rows with their first 448 keys in one shared prefix, the rate over keys another row read first (cache-hot).
    None when the kernel is unavailable or not float32."""
    from ..runner.cpu import cpu_kernels
    from ..sim.cost import kernel_thread_bytes

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
    (`cbnb.runner.cpu.attention._gather_pages`) and masked attention, 16 rows over 512 keys in pages of 16; returns the
    bytes the cost model counts for it per second."""
    from ..runner.cpu.attention import _gather_pages
    from ..sim.cost import gathered_decode_bytes

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
    from ..runner.cpu.attention import _gather_pages, _sdpa

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
    """The CPU runner's compiled prefill kernel (`cbnb.runner.cpu.cpu_kernels.paged_prefill`, what the runner uses for
    the prefill chunks of full-attention layers in float32): ``t = call + flops / rate`` fitted by least squares
    (relative error) over `_PREFILL_POINTS`, flops = ``4 H d`` per causal query-key pair; returns {"flops",
    "call_s"}, or None when the runner would not use the kernel."""
    from ..runner.cpu import cpu_kernels

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
