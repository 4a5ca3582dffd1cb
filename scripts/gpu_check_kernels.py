"""The ``kernels`` section of the device check (`scripts/gpu_check.py`): Triton kernels against their PyTorch
references, and timings at the nanovllm-256 decode shape against the memory-bandwidth floor.

Every case builds its inputs with `case_inputs`, which sizes the cache from the case itself (the block tables of R
requests of up to ``width`` blocks need ``width * R`` distinct blocks plus block 0). The CPU smoke run builds the
inputs of *every* GPU case on CPU tensors (without the cache) before running its own small cases, so a construction
error in a GPU case fails in CI, not on the device.
"""

from __future__ import annotations

import random
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

DATASHEET_BW = 4.8e12  # H200 HBM3e, bytes/s (vendor datasheet)
TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


@dataclass(frozen=True)
class KernelCase:
    """One correctness case: heads, KV heads, head_dim, page size, sliding window (0: full), decode splits."""

    H: int
    hkv: int
    D: int
    P: int
    window: int
    splits: int
    dtype: torch.dtype
    requests: int = 24  # decode requests
    max_past: int = 1500  # past lengths drawn in [0, max_past)
    max_chunk: int = 300  # prefill chunk lengths drawn in [2, max_chunk)


GPU_CASES = [
    KernelCase(16, 8, 128, 256, 0, 1, torch.bfloat16), KernelCase(16, 8, 128, 16, 0, 8, torch.bfloat16),
    KernelCase(12, 4, 64, 32, 0, 4, torch.float16), KernelCase(8, 8, 64, 16, 0, 2, torch.float32),
    KernelCase(4, 1, 256, 16, 512, 4, torch.bfloat16), KernelCase(9, 3, 64, 16, 40, 1, torch.float32),
]
SMOKE_CASES = [KernelCase(4, 2, 64, 16, 0, 2, torch.float16, 3, 60, 40),
               KernelCase(4, 1, 64, 16, 24, 1, torch.float32, 3, 60, 40)]
PREFILL_SEQS = 5
PAD_ROWS = 7  # extra query rows no sequence owns


def _i32(x: Any, device: str) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def _blocks_needed(tokens: int, case: KernelCase) -> int:
    return -(-min(tokens, case.window) // case.P) if case.window else -(-tokens // case.P)


def _table(rows: int, width: int, nb: int, device: str, gen: torch.Generator | None) -> torch.Tensor:
    """``[rows, width]`` distinct block ids in ``[1, nb)`` (block 0 is the read-padding block)."""
    if width * rows > nb - 1:
        raise ValueError(f"{rows} x {width} blocks do not fit a cache of {nb} blocks")
    perm = torch.randperm(nb - 1, generator=gen)[: width * rows].view(rows, width) + 1
    return perm.to(device=device, dtype=torch.int32)


def case_inputs(case: KernelCase, rng: random.Random, device: str, *, with_cache: bool = True,
                seed: int = 1) -> dict[str, Any]:
    """The decode and prefill inputs of one case (metadata, block tables and, with `with_cache`, the cache and the
    query/key/value tensors). The cache has exactly the blocks the tables need (``nb``)."""
    R = case.requests
    past = [rng.randrange(0, case.max_past) for _ in range(R)]
    dec_width = -(-case.window // case.P) if case.window else max(_blocks_needed(p + 1, case) for p in past)
    lens = [rng.randrange(2, case.max_chunk) for _ in range(PREFILL_SEQS)]
    pasts = [rng.randrange(0, case.max_past) if i % 2 else 0 for i in range(PREFILL_SEQS)]
    pre_width = -(-case.window // case.P) if case.window else max(
        _blocks_needed(p + n, case) for p, n in zip(pasts, lens))
    nb = 1 + max(dec_width * R, pre_width * PREFILL_SEQS)
    gen = torch.Generator().manual_seed(seed)
    dec_table = _table(R, dec_width, nb, device, gen)
    dec_table[:, 0] = dec_table[0, 0]  # a block shared by every request
    pre_table = _table(PREFILL_SEQS, pre_width, nb, device, gen)
    starts, a = [], 0
    for n in lens:
        starts.append(a)
        a += n
    out: dict[str, Any] = {"nb": nb, "past": past, "dec_table": dec_table, "lens": lens, "pasts": pasts,
                           "starts": starts, "rows": a, "pre_table": pre_table}
    if with_cache:
        g = torch.Generator(device=device).manual_seed(seed)
        # K/V views with the pool's strides: [nb, 2 (layers), 2 (K, V), P, hkv, D], the second layer's K and V
        buf = torch.randn(nb, 2, 2, case.P, case.hkv, case.D, generator=g, device=device).to(case.dtype)
        out["k_cache"], out["v_cache"] = buf[:, 1, 0], buf[:, 1, 1]
        mk = lambda *s: torch.randn(*s, generator=g, device=device).to(case.dtype)  # noqa: E731
        out["q_dec"] = mk(R + 3, case.H, case.D)
        T = a + PAD_ROWS
        out["q"], out["k"], out["v"] = mk(T, case.H, case.D), mk(T, case.hkv, case.D), mk(T, case.hkv, case.D)
    return out


def check_case(ta: Any, case: KernelCase, inp: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Decode and prefill kernels vs references on one case's inputs: one record per kernel."""
    R, D = case.requests, case.D
    tol = TOL[case.dtype]
    head = {"H": case.H, "hkv": case.hkv, "D": D, "P": case.P, "window": case.window, "dtype": str(case.dtype),
            "blocks": inp["nb"]}
    dargs = (_i32(list(range(R)) + [-1, -1], device), _i32(list(range(R)), device), _i32(inp["past"], device),
             inp["dec_table"], D ** -0.5, case.window)
    o1 = torch.zeros(R + 3, case.H, D, dtype=case.dtype, device=device)
    o2 = torch.zeros_like(o1)
    ta.paged_decode(inp["q_dec"], inp["k_cache"], inp["v_cache"], o1, *dargs, num_splits=case.splits)
    ta.ref_paged_decode(inp["q_dec"], inp["k_cache"], inp["v_cache"], o2, *dargs, num_splits=case.splits)
    err = (o1.float() - o2.float()).abs().max().item()
    out = [{"kernel": "decode", **head, "splits": case.splits, "max_abs_err": err, "ok": err <= tol}]
    bm = ta.kernel_config(D).prefill_m
    tiles = [(b, m0) for b, n in enumerate(inp["lens"]) for m0 in range(0, n, bm)] + [(-1, 0)] * 3
    pargs = (_i32([t[0] for t in tiles], device), _i32([t[1] for t in tiles], device), _i32(inp["starts"], device),
             _i32(inp["lens"], device), _i32(inp["pasts"], device), inp["pre_table"], D ** -0.5, case.window)
    o1 = torch.zeros(inp["rows"] + PAD_ROWS, case.H, D, dtype=case.dtype, device=device)
    o2 = torch.zeros_like(o1)
    ta.paged_prefill(inp["q"], inp["k"], inp["v"], inp["k_cache"], inp["v_cache"], o1, *pargs)
    ta.ref_paged_prefill(inp["q"], inp["k"], inp["v"], inp["k_cache"], inp["v_cache"], o2, *pargs)
    err = (o1.float() - o2.float()).abs().max().item()
    out.append({"kernel": "prefill", **head, "max_abs_err": err, "ok": err <= tol})
    return out


def cuda_time(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn` on the current stream (CUDA events; wall clock off CUDA)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _guarded(records: list[dict[str, Any]], label: dict[str, Any], fn: Callable[[], Any], log: Callable) -> None:
    """Run one case; its failure is a record, and the next case runs."""
    try:
        for rec in fn():
            records.append(rec)
            log(rec)
    except Exception as e:
        rec = {**label, "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        records.append(rec)
        log("!!", {k: v for k, v in rec.items() if k != "traceback"})


def decode_timings(ta: Any, sms: int, log: Callable, publish: Callable[[], None], timing: dict[str, Any]) -> None:
    """One layer of qwen3-0.6b (16 heads, 8 KV heads, head_dim 128, page 256) at nanovllm-256 decode shapes."""
    H, hkv, D, P = 16, 8, 128, 256
    for B, ctx in [(256, 1024), (256, 2048), (64, 1024), (8, 2048), (1, 2048)]:
        name = f"decode_B{B}_ctx{ctx}"
        try:
            width = -(-ctx // P)
            nb = B * width + 1
            kc = torch.randn(nb, P, hkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = _table(B, width, nb, "cuda", None)
            q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            splits = ta.num_decode_splits(B, hkv, ctx, sms)
            dargs = (_i32(list(range(B)), "cuda"), _i32(list(range(B)), "cuda"), _i32([ctx - 1] * B, "cuda"), table,
                     D ** -0.5, 0)
            ms = cuda_time(lambda: ta.paged_decode(q, kc, vc, out, *dargs, num_splits=splits))
            nbytes = B * ctx * hkv * D * 2 * 2
            timing[name] = {"ms": round(ms, 4), "splits": splits, "bytes": nbytes,
                            "gbs": round(nbytes / (ms * 1e-3) / 1e9, 1),
                            "floor_ms": round(nbytes / DATASHEET_BW * 1e3, 4)}
            del kc, vc
            import torch.nn.functional as F

            kd = torch.randn(B, hkv, ctx, D, device="cuda", dtype=torch.bfloat16)
            vd = torch.randn_like(kd)
            qd = q.view(B, H, 1, D)
            timing[name]["sdpa_contiguous_ms"] = round(
                cuda_time(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)), 4)
            del kd, vd
        except Exception as e:
            timing.setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"
        log(name, timing[name])
        publish()


def prefill_timing(ta: Any, timing: dict[str, Any]) -> None:
    """8 sequences x 1024 tokens without a past (compute-bound), and the K/V store of 8192 tokens."""
    H, hkv, D, P = 16, 8, 128, 256
    T, n = 8192, 1024
    try:
        kc = torch.randn(T // P + 2, P, hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
        bm = ta.kernel_config(D).prefill_m
        tiles = [(b, m0) for b in range(8) for m0 in range(0, n, bm)]
        pargs = (_i32([t[0] for t in tiles], "cuda"), _i32([t[1] for t in tiles], "cuda"),
                 _i32([b * n for b in range(8)], "cuda"), _i32([n] * 8, "cuda"), _i32([0] * 8, "cuda"),
                 torch.zeros(8, 4, dtype=torch.int32, device="cuda"), D ** -0.5, 0)
        out = torch.empty_like(q)
        ms = cuda_time(lambda: ta.paged_prefill(q, k, v, kc, vc, out, *pargs))
        flops = 8 * 4.0 * n * n / 2 * H * D
        timing["prefill_8x1024"] = {"ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}
        slots = torch.arange(T, dtype=torch.int32, device="cuda")
        ms = cuda_time(lambda: ta.store_kv(k, v, kc, vc, slots))
        timing["store_8192"] = {"ms": round(ms, 4), "gbs": round(2 * 2 * T * hkv * D * 2 / (ms * 1e-3) / 1e9, 1)}
    except Exception as e:
        timing["prefill_error"] = f"{type(e).__name__}: {e}"


def run(smoke: bool, device: str, sms: int, log: Callable, publish: Callable[[dict[str, Any]], None]) -> dict:
    """The section: correctness of every case (each guarded), then timings (CUDA only)."""
    from cbnb.runner.cuda import triton_attention as ta

    res: dict[str, Any] = {"checks": [], "gpu_case_inputs": []}
    rng = random.Random(0)
    for case in GPU_CASES:  # the GPU cases' construction, exactly (tables only on CPU)
        label = {"kernel": "inputs", "H": case.H, "D": case.D, "P": case.P, "window": case.window}
        if smoke:
            _guarded(res["gpu_case_inputs"], label,
                     lambda c=case: [{**label, "blocks": case_inputs(c, rng, "cpu", with_cache=False)["nb"],
                                      "ok": True}], log)
        else:
            _guarded(res["checks"], label, lambda c=case: check_case(ta, c, case_inputs(c, rng, device), device),
                     log)
            publish(res)
            if device == "cuda":
                torch.cuda.empty_cache()
    if smoke:
        rng = random.Random(0)
        for case in SMOKE_CASES:
            label = {"kernel": "case", "H": case.H, "D": case.D, "P": case.P, "window": case.window}
            _guarded(res["checks"], label, lambda c=case: check_case(ta, c, case_inputs(c, rng, device), device),
                     log)
    res["all_ok"] = bool(res["checks"]) and all(c["ok"] for c in res["checks"] + res["gpu_case_inputs"])
    publish(res)
    if device != "cuda":
        return res
    res["timing"] = {}
    decode_timings(ta, sms, log, lambda: publish(res), res["timing"])
    prefill_timing(ta, res["timing"])
    log(res["timing"])
    return res
