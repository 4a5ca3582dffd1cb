#!/usr/bin/env python3
"""The device check of cbnb's GPU path: one prepared run (about 6-8 minutes on an H200) that writes
``gpu_check.json`` (results, written after every section) and ``gpu_check.log`` under ``--out`` (default ``$OUT``).

Sections (each guarded: a failure is recorded and the next section runs; a global deadline skips what would not fit):

1. ``env``: versions, device, multiprocessors, measured device-to-device copy bandwidth.
2. ``kernels``: the Triton kernels against their PyTorch references on the GPU (bf16, fp16, fp32; GQA; windows;
   splits), and timings of the decode kernel at the nanovllm-256 decode shape against the bandwidth floor.
3. ``fp32_tiny``: fp32 tiny models (llama, qwen3, gemma3, mistral) through the engine with graphs + async vs
   per-request ``model.generate``: the share of token-identical requests (target 100 %).
4. ``bf16_agreement``: bf16 ``shape:qwen3-0.6b`` (and tiny models): share of requests whose first 16 tokens match
   per-request ``generate`` in bf16 (expected >= 95 %).
5. ``bench``: nanovllm-256 with ``shape:qwen3-0.6b`` (``--scale``, default 1.0): cbnb with graphs on/off x async
   on/off (async without graphs is refused by the runner: that variant runs synchronously and says so), output
   tok/s, peak GPU memory, per-step GPU time against the bandwidth floor ((weights + KV bytes read) / 4.8 TB/s, and
   / the measured copy bandwidth); then cbnb and transformers' continuous batching (``hf-cb``) side by side on the
   same workload at ``--hf-scale`` (default 0.25: transformers measured 640 tok/s here, i.e. minutes at full scale).

Run from the repository root with the machine's python3 (no virtualenv; no gguf/ipywidgets needed)::

    python3 scripts/gpu_check.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATASHEET_BW = 4.8e12  # H200 HBM3e, bytes/s (vendor datasheet)
DEV = "cuda"  # "cpu" with --cpu-smoke (a plumbing check of this script on a machine without a GPU)
SMOKE = False
RESULTS: dict[str, Any] = {"sections": {}}
LOG = None
T_START = time.time()


def log(*parts: Any) -> None:
    msg = " ".join(str(p) for p in parts)
    line = f"[{time.time() - T_START:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def save(out: str) -> None:
    RESULTS["elapsed_s"] = round(time.time() - T_START, 1)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)


def section(name: str, fn: Callable[[], Any], out: str, deadline: float, need_s: float) -> None:
    left = deadline - (time.time() - T_START)
    if left < need_s:
        RESULTS["sections"][name] = {"skipped": f"{left:.0f} s left, section needs ~{need_s:.0f} s"}
        log(f"== {name}: SKIPPED ({left:.0f} s left)")
        save(out)
        return
    log(f"== {name}")
    t0 = time.time()
    try:
        res = fn()
        RESULTS["sections"][name] = {"ok": True, "seconds": round(time.time() - t0, 1), **(res or {})}
    except Exception as e:  # keep going: one failing section must not hide the others
        RESULTS["sections"][name] = {"ok": False, "seconds": round(time.time() - t0, 1),
                                     "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"!! {name} failed: {type(e).__name__}: {e}")
        log(traceback.format_exc())
    save(out)
    free_gpu()


def free_gpu() -> None:
    import torch

    gc.collect()
    if DEV == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_time(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn` on the current stream (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    if DEV != "cuda":
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


# ------------------------------------------------------------------------------------------------ 1. env
def sec_env() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"unavailable: {e}"
    for mod in ("gguf", "ipywidgets"):
        try:
            __import__(mod)
            info[mod] = "present"
        except Exception:
            info[mod] = "absent"
    import cbnb  # noqa: F401  (must import without gguf / ipywidgets)

    info["cbnb_import"] = "ok"
    if SMOKE:
        return info
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this script is for the GPU machine")
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}")
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=10)
    info["copy_bw_gbs"] = round(2 * n / (ms * 1e-3) / 1e9, 1)  # read + write
    RESULTS["measured_bw"] = 2 * n / (ms * 1e-3)
    del a, b
    log(info)
    return info


# ------------------------------------------------------------------------------------------------ 2. kernels
def _cache(nb: int, P: int, hkv: int, D: int, dtype, seed: int):
    import torch

    g = torch.Generator(device=DEV).manual_seed(seed)
    buf = torch.randn(nb, 2, 2, P, hkv, D, generator=g, device=DEV).to(dtype)
    return buf[:, 1, 0], buf[:, 1, 1]


def sec_kernels() -> dict[str, Any]:
    import torch

    from cbnb.runner import triton_attention as ta

    if not ta.HAS_TRITON:
        raise RuntimeError(ta.TRITON_ERROR)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    checks = []
    tol = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}
    rng = random.Random(0)
    cases = [
        (16, 8, 128, 256, 0, 1, torch.bfloat16), (16, 8, 128, 16, 0, 8, torch.bfloat16),
        (12, 4, 64, 32, 0, 4, torch.float16), (8, 8, 64, 16, 0, 2, torch.float32),
        (4, 1, 256, 16, 512, 4, torch.bfloat16), (9, 3, 64, 16, 40, 1, torch.float32),
    ]
    big = 1500
    if SMOKE:
        cases = [(4, 2, 64, 16, 0, 2, torch.float16), (4, 1, 64, 16, 24, 1, torch.float32)]
        big = 60
    for (H, hkv, D, P, window, splits, dtype) in cases:
        nb = 600 if not SMOKE else 64
        kc, vc = _cache(nb, P, hkv, D, dtype, 1)
        R = 24 if not SMOKE else 3
        past = [rng.randrange(0, big) for _ in range(R)]
        need = [(-(-min(p + 1, window) // P) if window else -(-(p + 1) // P)) for p in past]
        width = -(-window // P) if window else max(need)
        perm = torch.randperm(nb - 1, device=DEV)[: width * R].view(R, width) + 1
        perm[:, 0] = perm[0, 0]  # a shared first block
        table = perm.to(torch.int32)
        T = R + 3
        q = torch.randn(T, H, D, device=DEV).to(dtype)
        q_start = i32(list(range(R)))
        dec = i32(list(range(R)) + [-1, -1])
        args = (dec, q_start, i32(past), table, D ** -0.5, window)
        o1 = torch.zeros(T, H, D, dtype=dtype, device=DEV)
        o2 = torch.zeros_like(o1)
        ta.paged_decode(q, kc, vc, o1, *args, num_splits=splits)
        ta.ref_paged_decode(q, kc, vc, o2, *args, num_splits=splits)
        err = (o1.float() - o2.float()).abs().max().item()
        checks.append({"kernel": "decode", "H": H, "hkv": hkv, "D": D, "P": P, "window": window, "splits": splits,
                       "dtype": str(dtype), "max_abs_err": err, "ok": err <= tol[dtype]})
        # prefill with a past (prefix hits / chunks), several sequences, padded work-list entries
        bm = ta.kernel_config(D).prefill_m
        lens = [rng.randrange(2, 300 if not SMOKE else 40) for _ in range(5)]
        pasts = [rng.randrange(0, big) if i % 2 else 0 for i in range(5)]
        starts, a = [], 0
        for n in lens:
            starts.append(a)
            a += n
        width = -(-window // P) if window else max(-(-(p + n) // P) for p, n in zip(pasts, lens))
        table = (torch.randperm(nb - 1, device=DEV)[: width * 5].view(5, width) + 1).to(torch.int32)
        q = torch.randn(a + 7, H, D, device=DEV).to(dtype)
        k = torch.randn(a + 7, hkv, D, device=DEV).to(dtype)
        v = torch.randn(a + 7, hkv, D, device=DEV).to(dtype)
        tiles = [(b, m0) for b, n in enumerate(lens) for m0 in range(0, n, bm)] + [(-1, 0)] * 3
        pargs = (i32([t[0] for t in tiles]), i32([t[1] for t in tiles]), i32(starts), i32(lens), i32(pasts), table,
                 D ** -0.5, window)
        o1 = torch.zeros(a + 7, H, D, dtype=dtype, device=DEV)
        o2 = torch.zeros_like(o1)
        ta.paged_prefill(q, k, v, kc, vc, o1, *pargs)
        ta.ref_paged_prefill(q, k, v, kc, vc, o2, *pargs)
        err = (o1.float() - o2.float()).abs().max().item()
        checks.append({"kernel": "prefill", "H": H, "hkv": hkv, "D": D, "P": P, "window": window,
                       "dtype": str(dtype), "max_abs_err": err, "ok": err <= tol[dtype]})
    for c in checks:
        log(c)
    if SMOKE:
        return {"checks": checks, "all_ok": all(c["ok"] for c in checks)}
    # timing: nanovllm-256 decode shape (qwen3-0.6b: 16 heads, 8 KV heads, head_dim 128, page 256), one layer
    timing = {}
    H, hkv, D, P = 16, 8, 128, 256
    for B, ctx in [(256, 1024), (256, 2048), (64, 1024), (8, 2048), (1, 2048)]:
        nb = B * (-(-ctx // P)) + 1
        kc, vc = _cache(nb, P, hkv, D, torch.bfloat16, 2)
        width = -(-ctx // P)
        table = (torch.randperm(nb - 1, device="cuda")[: B * width].view(B, width) + 1).to(torch.int32)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        splits = ta.num_decode_splits(B, hkv, ctx, RESULTS.get("sms", 132))
        dargs = (i32(list(range(B))), i32(list(range(B))), i32([ctx - 1] * B), table, D ** -0.5, 0)
        ms = cuda_time(lambda: ta.paged_decode(q, kc, vc, out, *dargs, num_splits=splits))
        nbytes = B * ctx * hkv * D * 2 * 2
        timing[f"decode_B{B}_ctx{ctx}"] = {"ms": round(ms, 4), "splits": splits, "bytes": nbytes,
                                           "gbs": round(nbytes / (ms * 1e-3) / 1e9, 1),
                                           "floor_ms": round(nbytes / DATASHEET_BW * 1e3, 4)}
        try:  # reference point: torch SDPA over contiguous (not paged) K/V of the same size
            import torch.nn.functional as F

            kd = torch.randn(B, hkv, ctx, D, device="cuda", dtype=torch.bfloat16)
            vd = torch.randn_like(kd)
            qd = q.view(B, H, 1, D)
            ms2 = cuda_time(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
            timing[f"decode_B{B}_ctx{ctx}"]["sdpa_contiguous_ms"] = round(ms2, 4)
            del kd, vd
        except Exception as e:
            timing[f"decode_B{B}_ctx{ctx}"]["sdpa_contiguous_ms"] = f"{type(e).__name__}: {e}"
        log("decode", B, ctx, timing[f"decode_B{B}_ctx{ctx}"])
        del kc, vc
    # prefill: 8 sequences x 1024 tokens, no past (compute-bound)
    T, n = 8192, 1024
    kc, vc = _cache(T // P + 2, P, hkv, D, torch.bfloat16, 3)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
    bm = ta.kernel_config(D).prefill_m
    tiles = [(b, m0) for b in range(8) for m0 in range(0, n, bm)]
    pargs = (i32([t[0] for t in tiles]), i32([t[1] for t in tiles]), i32([b * n for b in range(8)]), i32([n] * 8),
             i32([0] * 8), torch.zeros(8, 4, dtype=torch.int32, device="cuda"), D ** -0.5, 0)
    out = torch.empty_like(q)
    ms = cuda_time(lambda: ta.paged_prefill(q, k, v, kc, vc, out, *pargs))
    flops = 8 * 4.0 * n * n / 2 * H * D
    timing["prefill_8x1024"] = {"ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}
    slots = torch.arange(T, dtype=torch.int32, device="cuda")
    ms = cuda_time(lambda: ta.store_kv(k, v, kc, vc, slots))
    timing["store_8192"] = {"ms": round(ms, 4), "gbs": round(2 * 2 * T * hkv * D * 2 / (ms * 1e-3) / 1e9, 1)}
    log(timing)
    return {"checks": checks, "all_ok": all(c["ok"] for c in checks), "timing": timing}


# ------------------------------------------------------------------------------------------------ engine helpers
def gen_reference(model, prompt: list[int], n: int) -> list[int]:
    import torch

    dev = next(model.parameters()).device  # noqa: F841
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def no_eos(model) -> None:
    gc_ = getattr(model, "generation_config", None)
    if gc_ is not None:
        gc_.eos_token_id = None


def engine_tokens(model, prompts, n, cfg, describe: dict | None = None) -> list[list[int]]:
    import cbnb

    eng = cbnb.Engine(model, config=cfg)
    try:
        with eng:
            hs = [eng.submit(p, max_new_tokens=n, eos_token_id=-1, ignore_eos=True) for p in prompts]
            outs = [h.result(timeout=600) for h in hs]
        if describe is not None and hasattr(eng.runner, "describe"):
            describe.update(eng.runner.describe())
            describe["runner"] = type(eng.runner).__name__
            describe["stats_graphs"] = (eng.stats()["run"]["cuda_graph_captures"],
                                        eng.stats()["run"]["cuda_graph_replays"])
    finally:
        del eng
        free_gpu()
    bad = [o for o in outs if o.state.name != "FINISHED"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests not FINISHED: {bad[0].error}")
    return [o.token_ids for o in outs]


# ------------------------------------------------------------------------------------------------ 3. fp32 tiny
def sec_fp32_tiny() -> dict[str, Any]:
    import torch

    import cbnb
    from cbnb.models import load_model

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 13, 17, 30, 47, 60, 90, 3)]
    res = {}
    names = ("tiny:llama", "tiny:qwen3", "tiny:gemma3", "tiny:mistral") if not SMOKE else ("tiny:gemma3",)
    for name in names:
        model, _ = load_model(name, dtype=torch.float32, device=DEV)
        no_eos(model)
        refs = [gen_reference(model, p, 24) for p in prompts]
        per = {}
        small = dict(page_size=16, num_blocks=256, max_requests_per_batch=64, max_batch_tokens=512,
                     kv_padding_interval_size=512)
        configs = [
            ("graphs_async_chunked", cbnb.ContinuousBatchingConfig(**{**small, "max_batch_tokens": 32,
                                                                       "kv_padding_interval_size": 64},
                                                                    q_padding_interval_size=16)),
            ("graphs_sync", cbnb.ContinuousBatchingConfig(**small, use_async_batching=False)),
            ("eager", cbnb.ContinuousBatchingConfig(**small, use_cuda_graph=False)),
        ]
        # every variant on a pure full-attention and a hybrid sliding model; graphs + async on the other two
        for label, cfg in configs[: 1 if SMOKE or name in ("tiny:qwen3", "tiny:mistral") else 3]:
            d: dict[str, Any] = {}
            toks = engine_tokens(model, prompts, 24, cfg, d)
            match = sum(t == r for t, r in zip(toks, refs)) / len(refs)
            per[label] = {"identical_share": match, "runner": d.get("runner"), "graphs": d.get("graphs"),
                          "async": d.get("async"), "captures": d.get("captures"), "replays": d.get("replays"),
                          "carried_tokens": d.get("carried_tokens")}
            log(name, label, per[label])
        res[name] = per
        del model
        free_gpu()
    ok = all(v["identical_share"] == 1.0 for per in res.values() for v in per.values())
    return {"models": res, "all_identical": ok}


# ------------------------------------------------------------------------------------------------ 4. bf16 agreement
def sec_bf16() -> dict[str, Any]:
    import torch

    import cbnb
    from cbnb.models import load_model

    out = {}
    models = (("shape:qwen3-0.6b", 48, 151936), ("tiny:llama", 32, 512), ("tiny:gemma3", 32, 512))
    if SMOKE:
        models = (("tiny:llama", 4, 512),)
    for name, n_req, vocab in models:
        model, _ = load_model(name, dtype=torch.bfloat16, device=DEV)
        no_eos(model)
        rng = random.Random(3)
        prompts = [[rng.randrange(32, vocab) for _ in range(rng.randint(16, 160))] for _ in range(n_req)]
        refs = [gen_reference(model, p, 16) for p in prompts]
        cfg = cbnb.ContinuousBatchingConfig(page_size=256 if name.startswith("shape") else 16, num_blocks=256,
                                            max_batch_tokens=2048, max_requests_per_batch=64)
        d: dict[str, Any] = {}
        toks = engine_tokens(model, prompts, 16, cfg, d)
        share = sum(t[:16] == r[:16] for t, r in zip(toks, refs)) / len(refs)
        first_div = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), 16) for t, r in zip(toks, refs)]
        out[name] = {"requests": n_req, "first16_match_share": share, "mean_first_divergence": sum(first_div) / n_req,
                     "graphs": d.get("graphs"), "async": d.get("async")}
        log(name, out[name])
        del model
        free_gpu()
    return {"models": out}


# ------------------------------------------------------------------------------------------------ 5. bench
def _floor_report(step_log: list[dict], weight_bytes: int, measured_bw: float | None) -> dict[str, Any]:
    dec = [s for s in step_log if s["kind"] == "decode" and s.get("gpu_ms") is not None]
    if not dec:
        return {}
    rows = []
    for s in dec:
        floor = (weight_bytes + s["kv_bytes"]) / DATASHEET_BW * 1e3
        rows.append((s["requests"], s["gpu_ms"], floor))
    rows.sort(key=lambda r: r[0])

    def summarize(sel):
        if not sel:
            return None
        g = sorted(r[1] for r in sel)
        f = sorted(r[2] for r in sel)
        return {"steps": len(sel), "gpu_ms_median": round(g[len(g) // 2], 3),
                "floor_ms_median": round(f[len(f) // 2], 3),
                "floor_over_gpu": round(sum(r[2] for r in sel) / sum(r[1] for r in sel), 3)}

    out = {"all_decode": summarize(rows),
           "by_batch": {f"{lo}-{hi}": summarize([r for r in rows if lo <= r[0] <= hi])
                        for lo, hi in ((1, 31), (32, 127), (128, 255), (256, 1024))}}
    tot = sum(r[1] for r in rows)
    out["decode_gpu_s_total"] = round(tot / 1e3, 3)
    out["decode_floor_s_total"] = round(sum(r[2] for r in rows) / 1e3, 3)
    if measured_bw:
        out["decode_floor_s_total_measured_bw"] = round(
            sum((weight_bytes + s["kv_bytes"]) / measured_bw for s in dec), 3)
    allg = [s for s in step_log if s.get("gpu_ms") is not None]
    out["all_steps_gpu_s"] = round(sum(s["gpu_ms"] for s in allg) / 1e3, 3)
    out["steps"] = len(step_log)
    out["decode_steps"] = len(dec)
    out["host_prepare_ms_median"] = round(sorted(s["host_prepare_s"] for s in step_log)[len(step_log) // 2] * 1e3, 3)
    return out


def sec_bench(scale: float, hf_scale: float, deadline: float, skip_hf: bool) -> dict[str, Any]:
    import torch

    import cbnb
    from cbnb import bench
    from cbnb.models import load_model
    from cbnb.workloads import get_workload

    model, tok = load_model("shape:qwen3-0.6b" if not SMOKE else "tiny:llama",
                            dtype=torch.bfloat16 if not SMOKE else torch.float32, device=DEV)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    wl = get_workload("nanovllm-256", vocab_size=vocab, scale=scale)
    hints = dict(wl.config_hints)
    if SMOKE:  # transformers' CB on CPU needs explicit sizes (its defaults reserve ~8 GiB)
        hints.update(num_blocks=64, max_batch_tokens=128, page_size=16)
    base_cfg = cbnb.ContinuousBatchingConfig(**hints)
    res: dict[str, Any] = {"workload": {"scale": scale, "requests": wl.num_requests, "prompt_tokens": wl.prompt_tokens,
                                        "output_tokens": wl.output_tokens}, "weight_bytes": weight_bytes,
                           "variants": {}}
    RESULTS["sections"]["bench"] = res  # partial results survive a timeout (saved after each run)
    state = {"first": None, "last_s": None, "prev_graphs": True}

    def variant(label: str, graphs: bool, async_: bool) -> None:
        left = deadline - (time.time() - T_START)
        # the next variant's cost: the last one's wall time (x2.5 when going from graphs to eager), or a guess
        last = state["last_s"]
        est = 60.0 if last is None else last * (2.5 if (not graphs and state["prev_graphs"]) else 1.2)
        if left < est:
            res["variants"][label] = {"skipped": f"{left:.0f} s left, needs ~{est:.0f} s"}
            log(label, "skipped", round(left), round(est))
            return
        cfg = base_cfg.copy(use_cuda_graph=graphs, use_async_batching=async_)
        holder: dict[str, Any] = {}

        def hook(eng, holder=holder):
            eng.runner.profile = True
            holder["runner"] = eng.runner
            holder["engine_memory"] = eng.memory_split()
            holder["config"] = eng.config.to_dict()

        t_var = time.time()
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        r = bench.run_cbnb(model, tok, wl, cfg, name=f"cbnb[{label}]", on_engine=hook)
        runner = holder.pop("runner", None)
        d = runner.describe() if hasattr(runner, "describe") else {}
        floor = _floor_report(getattr(runner, "step_log", []), weight_bytes, RESULTS.get("measured_bw"))
        run = r.extra.get("stats", {}).get("run", {})
        entry = {"seconds": round(r.seconds, 3), "output_tokens": r.output_tokens, "tok_per_s": round(r.tok_per_s, 1),
                 "peak_allocated_bytes": r.peak_bytes,
                 "peak_reserved_bytes": torch.cuda.max_memory_reserved() if DEV == "cuda" else None,
                 "error": r.error, "runner": type(runner).__name__, "effective": d, "per_step": floor,
                 "memory_split": holder.get("engine_memory"), "steps": run.get("steps"),
                 "graph_counts": (run.get("cuda_graph_captures"), run.get("cuda_graph_replays")),
                 "wall_incl_engine_setup_s": None}
        if state["first"] is None:
            state["first"] = r
        else:
            entry["greedy_agreement_vs_first"] = bench.agreement(state["first"], r)
        del runner, holder, r
        free_gpu()
        state["last_s"] = time.time() - t_var
        entry["wall_incl_engine_setup_s"] = round(state["last_s"], 1)
        state["prev_graphs"] = graphs
        res["variants"][label] = entry
        log(label, {k: v for k, v in entry.items() if k not in ("effective", "memory_split")})
        save(ARGS.out)

    def side_by_side() -> None:
        # side by side with transformers' continuous batching, same workload (scaled), same config values
        wls = get_workload("nanovllm-256", vocab_size=vocab, scale=hf_scale)
        res["side_by_side"] = {"scale": hf_scale, "requests": wls.num_requests, "output_tokens": wls.output_tokens}
        cfg = base_cfg
        r1 = bench.run_cbnb(model, tok, wls, cfg, name="cbnb")
        free_gpu()
        log("cbnb (side by side)", round(r1.tok_per_s, 1), r1.error)
        r2 = bench._guard("hf-cb", lambda: bench.run_hf_cb(model, wls, cfg))
        free_gpu()
        log("hf-cb", round(r2.tok_per_s, 1), r2.error)
        res["side_by_side"]["cbnb"] = {"seconds": round(r1.seconds, 3), "tok_per_s": round(r1.tok_per_s, 1),
                                       "peak_allocated_bytes": r1.peak_bytes, "error": r1.error}
        res["side_by_side"]["hf_cb"] = {"seconds": round(r2.seconds, 3), "tok_per_s": round(r2.tok_per_s, 1),
                                        "peak_allocated_bytes": r2.peak_bytes, "error": r2.error}
        res["side_by_side"]["speedup"] = round(r1.tok_per_s / r2.tok_per_s, 2) if r2.tok_per_s else None
        res["side_by_side"]["greedy_agreement"] = bench.agreement(r1, r2)

    # Priority order (the deadline may cut the tail): the headline variant, the side-by-side with transformers,
    # then the remaining variants of the graphs x async matrix.
    variant("graphs_on_async_on", True, True)
    if not skip_hf:
        left = deadline - (time.time() - T_START)
        if left > 60:
            try:
                side_by_side()
            except Exception as e:
                res["side_by_side_error"] = f"{type(e).__name__}: {e}"
                log("side by side failed:", e)
        else:
            res["side_by_side"] = {"skipped": f"{left:.0f} s left"}
        save(ARGS.out)
    variant("graphs_on_async_off", True, False)
    variant("graphs_off_async_off", False, False)
    variant("graphs_off_async_on", False, True)
    return res


def summary() -> dict[str, Any]:
    """Headline figures (None where a section did not run)."""
    sec = RESULTS["sections"]
    out: dict[str, Any] = {"target_tok_per_s": 20000}
    b = sec.get("bench", {})
    head = b.get("variants", {}).get("graphs_on_async_on", {})
    tok = out["cbnb_tok_per_s"] = head.get("tok_per_s")
    out["workload_scale"] = b.get("workload", {}).get("scale")
    out["target_met"] = None if tok is None else tok >= out["target_tok_per_s"]
    out["variants_tok_per_s"] = {k: v.get("tok_per_s") for k, v in b.get("variants", {}).items()}
    sbs = b.get("side_by_side", {})
    out["side_by_side"] = {"scale": sbs.get("scale"), "cbnb": (sbs.get("cbnb") or {}).get("tok_per_s"),
                           "hf_cb": (sbs.get("hf_cb") or {}).get("tok_per_s"), "speedup": sbs.get("speedup")}
    out["decode_floor_over_gpu"] = ((head.get("per_step") or {}).get("all_decode") or {}).get("floor_over_gpu")
    out["peak_allocated_gib"] = round(head["peak_allocated_bytes"] / 2**30, 2) if head.get("peak_allocated_bytes") \
        else None
    out["kernels_ok"] = sec.get("kernels", {}).get("all_ok")
    out["fp32_tiny_all_identical"] = sec.get("fp32_tiny", {}).get("all_identical")
    out["bf16_first16_share"] = {k: v.get("first16_match_share")
                                 for k, v in sec.get("bf16_agreement", {}).get("models", {}).items()}
    return out


# ------------------------------------------------------------------------------------------------ main
ARGS: argparse.Namespace


def main(argv: list[str] | None = None) -> int:
    global LOG, ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--scale", type=float, default=1.0, help="nanovllm-256 scale for the cbnb variants")
    ap.add_argument("--hf-scale", type=float, default=0.25, help="scale of the cbnb vs hf-cb side-by-side run")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sections", default="env,kernels,fp32_tiny,bf16_agreement,bench")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="plumbing check without a GPU: tiny shapes, Triton interpreter, fake graphs")
    ARGS = ap.parse_args(argv)
    if ARGS.cpu_smoke:
        global DEV, SMOKE
        DEV, SMOKE = "cpu", True
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["CBNB_CUDA_RUNNER"] = "fake"
        ARGS.scale = min(ARGS.scale, 0.03)
        ARGS.hf_scale = min(ARGS.hf_scale, 0.03)
    os.makedirs(ARGS.out, exist_ok=True)
    LOG = open(os.path.join(ARGS.out, "gpu_check.log"), "w")
    RESULTS["args"] = vars(ARGS)
    want = set(ARGS.sections.split(","))
    plan = [("env", sec_env, 20), ("kernels", sec_kernels, 60), ("fp32_tiny", sec_fp32_tiny, 60),
            ("bf16_agreement", sec_bf16, 60),
            ("bench", lambda: sec_bench(ARGS.scale, ARGS.hf_scale, ARGS.deadline, ARGS.no_hf), 120)]
    for name, fn, need in plan:
        if name in want:
            section(name, fn, ARGS.out, ARGS.deadline, need)
            if name == "env" and RESULTS["sections"]["env"].get("sms"):
                RESULTS["sms"] = RESULTS["sections"]["env"]["sms"]
    RESULTS["summary"] = summary()
    log("summary", json.dumps(RESULTS["summary"], default=str))
    log("done; results in", os.path.join(ARGS.out, "gpu_check.json"))
    save(ARGS.out)
    LOG.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
