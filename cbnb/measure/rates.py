"""The machine's rates behind the bench's roofline floor (`cbnb.bench.roofline`), measured in the same run as the
peers: the model's own linear layers at the workload's row counts (`gemm_rate`), a square GEMM (`square_gemm_rate`),
the copy bandwidth (`bandwidth`); `probe` takes all of them at once. Each is the fastest of a few passes (contention
only slows a pass). torch is imported when a probe runs."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["gemm_rate", "square_gemm_rate", "bandwidth", "probe"]


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def gemm_rate(model: Any, rows: int, include_head: bool, reps: int = 3, min_s: float = 0.0) -> dict[str, float]:
    """FLOP/s of the model's own linear layers applied to ``rows`` random tokens: the fastest of at least `reps`
    passes, repeated until `min_s` seconds have passed (what the machine can do; contention only slows a pass).

    One pass applies every `nn.Linear` (the LM head only with `include_head`) once, in module order, each to an
    activation ``[rows, in_features]`` in the weight's dtype and device. On CPU, passes alternate between
    ``F.linear``, the CPU runner's linear (`cbnb.runner.cpu.cpu_linear.runner_linear`: oneDNN, on packed weights while
    packing is on) when it differs, and, when the runner fuses sibling projections (`cpu_linear.fused_groups`), that
    linear over the fused weights; the fastest pass of any counts: the floor is what the best GEMM reaches
    (``"impl"`` names it).
    """
    import torch
    import torch.nn.functional as F

    head_mod = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and (include_head or m is not head_mod)]
    w0 = linears[0].weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = {i: torch.randn(rows, i, generator=gen).to(w0.device, w0.dtype) for i in {m.in_features for m in linears}}
    flops = 2.0 * rows * sum(m.in_features * m.out_features for m in linears)
    plain = [(m.in_features, m.weight) for m in linears]
    impls: dict[str, Any] = {"F.linear": (F.linear, plain)}
    if w0.device.type == "cpu":
        from ..runner.cpu import cpu_linear

        alt = cpu_linear.runner_linear(w0.dtype)
        if alt is not F.linear:
            impls["oneDNN"] = (alt, plain)
            if cpu_linear.packing():
                leader = {id(g[0]): g for g in cpu_linear.fused_groups(model)}
                member = {id(m) for g in leader.values() for m in g}
                fused = []
                for m in linears:
                    if id(m) in leader:
                        fused.append((m.in_features, torch.cat([x.weight for x in leader[id(m)]])))
                    elif id(m) not in member:
                        fused.append((m.in_features, m.weight))
                if len(fused) < len(plain):
                    impls["oneDNN fused"] = (cpu_linear.runner_linear(w0.dtype), fused)
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    with torch.inference_mode():
        r = 0
        # pass 0 of each implementation warms up (allocator, weight pages, packing)
        while r <= (reps + 1) * len(names) - 1 or time.perf_counter() - start < min_s:
            name = names[r % len(names)]
            linear, units = impls[name]
            _sync(w0.device)
            t0 = time.perf_counter()
            for k, w in units:
                linear(xs[k], w)
            _sync(w0.device)
            if r >= len(names):
                times[name].append(time.perf_counter() - t0)
            r += 1
    best = min(names, key=lambda n: min(times[n]))
    t = min(times[best])
    return {"rows": rows, "flops": flops, "seconds": t, "flops_per_s": flops / t, "impl": best}


def square_gemm_rate(n: int = 1024, reps: int = 3, device: Any = "cpu", dtype: Any = None) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul, fastest of `reps` (the reference figure older notes quote)."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for r in range(reps + 1):
        _sync(a.device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(a.device)
        if r:
            times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / min(times)


def bandwidth(num_bytes: int = 1 << 29, reps: int = 3, device: Any = "cpu") -> float:
    """Copy bandwidth in bytes/s (read + write) of a `num_bytes` buffer (default 512 MiB, past the 480 MiB L3 of the
    development machine), fastest of `reps` copies."""
    import torch

    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for r in range(reps + 1):
        _sync(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        if r:
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2.0 * n * 4 / min(times)


def probe(model: Any, prefill_rows: int, decode_rows: int) -> dict[str, Any]:
    """The machine's state now: GEMM rates at the workload's shapes, a 1024^2 GEMM and the copy bandwidth."""
    device = next(model.parameters()).device
    pre = gemm_rate(model, prefill_rows, include_head=False, reps=3, min_s=1.0)
    dec = gemm_rate(model, decode_rows, include_head=True, reps=5, min_s=1.0)
    return {
        "prefill_rows": prefill_rows, "prefill_flops_per_s": pre["flops_per_s"],
        "decode_rows": decode_rows, "decode_flops_per_s": dec["flops_per_s"],
        "prefill_gemm": pre["impl"], "decode_gemm": dec["impl"],
        "gemm_1024_flops_per_s": square_gemm_rate(1024, device=device, dtype=next(model.parameters()).dtype),
        "copy_bytes_per_s": bandwidth(device=device),
    }
