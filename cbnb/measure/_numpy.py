"""Rough NumPy measurements behind `cbnb.measure.calibrate` when torch is not installed (no cbnb runner to time)."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ._common import _ROWS, _median_time, _positive
from ..sim.shapes import ModelShape

METHODS = {
    "memory_bandwidth": "NumPy copy of 256 MiB, (read + write) bytes / s",
    "host_device_bandwidth": "NumPy fancy-index gather + scatter of whole blocks, block bytes / s",
    "peak_flops": "the fastest GEMM rate of gemm_flops",
    "gemm_flops": "NumPy float32 matmul at the shape's 7 decoder projections, weights cycled through 512 MiB",
    "attention_flops": "not measured: the GEMM rate at the same rows",
    "elementwise_curve": "NumPy multiply/add over [256, intermediate] rows",
    "kernel_launch_s": "one small NumPy op",
    "step_overhead_s": "estimated: 200 small ops (no torch to run cbnb's runner)",
    "layer_overhead_s": "estimated: 24 small ops per decoder layer",
    "attention_call_s": "estimated: 8 small ops per attention call",
    "request_overhead_s": "estimated: 20 small ops per request",
}


def measure(s: ModelShape, *, threads: int | None, quick: bool, log: Callable[..., None],
            budget_s: float = 60.0) -> dict[str, Any]:
    reps = 3 if quick else 5
    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    op = _median_time(lambda: [np.add(a, b) for _ in range(2000)], reps) / 2000
    n = (64 if quick else 256) << 20
    src = np.ones(n // 4, np.float32)
    dst = np.empty_like(src)
    bw = 2 * n / _median_time(lambda: np.copyto(dst, src), reps)
    rows, block = 1024, max(4096, n // 4 // 1024)
    pool = np.zeros((rows, block), np.uint8)
    idx = np.random.default_rng(0).permutation(rows)
    host = np.zeros_like(pool)

    def gather() -> None:
        host[idx] = pool[idx]

    swap = rows * block / _median_time(gather, reps)
    h, i, H, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    proj = [(h, H * d), (h, Hkv * d), (h, Hkv * d), (H * d, h), (h, i), (h, i), (i, h)]
    layer_bytes = sum(k * m for k, m in proj) * 4
    nl = max(1, min(s.num_layers, math.ceil((512 << 20) / layer_bytes)))
    ws = [[np.random.default_rng(j).standard_normal((k, m), dtype=np.float32) for k, m in proj] for j in range(nl)]
    curve = []
    for m in (_ROWS[::3] if quick else _ROWS):
        xs = {k: np.ones((m, k), np.float32) for k in {p[0] for p in proj}}

        def run() -> None:
            for layer in ws:
                for (k, _), w in zip(proj, layer):
                    xs[k] @ w

        t = _median_time(run, 2, min_s=0.05)
        curve.append([m, 2 * m * sum(k * q for k, q in proj) * nl / _positive(t, 1e-9)])
        log(f"GEMM rows={m}: {curve[-1][1] / 1e9:.1f} GFLOP/s")
    x, y = np.ones((256, i), np.float32), np.ones((256, i), np.float32)
    ew = [[256, 2 * 3 * x.nbytes / _median_time(lambda: (np.multiply(x, y, out=y), np.add(x, y, out=y)), reps)]]
    return {"backend": f"numpy {np.__version__}", "threads": threads or 0, "op_s": op, "bandwidth": bw,
            "swap_bandwidth": swap, "gemm": curve, "attention": curve, "elementwise": ew,
            "step_s": 200 * op, "layer_s": 24 * op, "call_s": 8 * op, "request_s": 20 * op}
