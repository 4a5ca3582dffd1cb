#!/usr/bin/env python3
"""One part of the device check, run in its own process by `scripts/gpu_check.py` (which documents the parts)::

    python3 scripts/gpu_check_units.py PART --out DIR --cap SECONDS [--scale S] [--hf-scale S] [--cpu-smoke]

A part publishes its results to ``DIR/parts/PART.json`` as it goes (so a part stopped at its cap keeps what it
measured) and stops starting new work a few seconds before its cap.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check import log, part_path, read_json, write_json  # noqa: E402
import gpu_check_kernels  # noqa: E402

DEV = "cuda"
SMOKE = False
ARGS: argparse.Namespace
T_END = float("inf")  # this part's soft deadline (time.time())
RES: dict[str, Any] = {}
MARGIN_S = 6.0


def publish(extra: dict[str, Any] | None = None) -> None:
    if extra is not None and extra is not RES:
        RES.update(extra)
    write_json(part_path(ARGS.out, ARGS.part), RES)


def left() -> float:
    return T_END - time.time()


def free_memory() -> None:
    import torch

    gc.collect()
    if DEV == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def load(name: str, dtype: str):
    import torch

    from cbnb.engine.models import load_model

    return load_model(name, dtype=getattr(torch, dtype), device=DEV)


def headline_model():
    """qwen3-0.6b's shape in bf16 (a tiny fp32 model in the CPU smoke run)."""
    return load("tiny:llama", "float32") if SMOKE else load("shape:qwen3-0.6b", "bfloat16")


def nanovllm(vocab: int, scale: float):
    import cbnb
    from cbnb.lab.workloads import get_workload

    wl = get_workload("nanovllm-256", vocab_size=vocab, scale=scale)
    hints = dict(wl.config_hints)
    if SMOKE:  # transformers' CB on CPU needs explicit sizes (its defaults reserve ~8 GiB)
        hints.update(num_blocks=64, max_batch_tokens=128, page_size=16)
    return wl, cbnb.ContinuousBatchingConfig(**hints)


# ------------------------------------------------------------------------------------------------ 1. probe
def part_probe() -> dict[str, Any]:
    import torch
    import transformers

    from cbnb.runner.cuda.device_checks import build_tools, triton_launch_check

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
                            "cuda_available": torch.cuda.is_available(), "build_tools": build_tools()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"unavailable: {type(e).__name__}: {e}"
    for mod in ("gguf", "ipywidgets"):
        try:
            __import__(mod)
            info[mod] = "present"
        except Exception:
            info[mod] = "absent"
    import cbnb  # noqa: F401  (must import without gguf / ipywidgets)

    info["cbnb_import"] = "ok"
    publish(info)
    if not SMOKE:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: this script is for the GPU machine (--cpu-smoke for a CPU run)")
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}")
    else:
        info.update(device="cpu (smoke run)", sms=132)
    t0 = time.time()
    ok, why = triton_launch_check(DEV)
    info["triton_launch"] = {"ok": ok, "reason": why, "seconds": round(time.time() - t0, 2)}
    info["attention"] = "triton" if ok and not SMOKE else "torch"
    if not ok:
        info["fallback"] = (f"Triton cannot launch here ({why}): the rest of the run uses the PyTorch reference "
                            "attention (no CUDA graphs, no async batching) and skips the kernel section")
    log("probe", info)
    publish(info)
    if not SMOKE:
        n = 1 << 30  # 1 GiB each way
        a = torch.empty(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        ms = gpu_check_kernels.cuda_time(lambda: b.copy_(a), iters=10)
        info["copy_bw_gbs"] = round(2 * n / (ms * 1e-3) / 1e9, 1)  # read + write
        info["measured_bw"] = 2 * n / (ms * 1e-3)
        log("copy bandwidth", info["copy_bw_gbs"], "GB/s")
    return info


# ------------------------------------------------------------------------------------------------ cbnb runs
def floor_report(step_log: list[dict], weight_bytes: int, measured_bw: float | None) -> dict[str, Any]:
    """Decode steps' GPU time against the bandwidth floor ((weights + KV read) / bandwidth)."""
    dec = [s for s in step_log if s["kind"] == "decode" and s.get("gpu_ms") is not None]
    if not dec:
        return {}
    rows = sorted((s["requests"], s["gpu_ms"], (weight_bytes + s["kv_bytes"]) / gpu_check_kernels.DATASHEET_BW * 1e3)
                  for s in dec)

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
                        for lo, hi in ((1, 31), (32, 127), (128, 255), (256, 1024))},
           "decode_gpu_s_total": round(sum(r[1] for r in rows) / 1e3, 3),
           "decode_floor_s_total": round(sum(r[2] for r in rows) / 1e3, 3)}
    if measured_bw:
        out["decode_floor_s_total_measured_bw"] = round(
            sum((weight_bytes + s["kv_bytes"]) / measured_bw for s in dec), 3)
    allg = [s for s in step_log if s.get("gpu_ms") is not None]
    out["all_steps_gpu_s"] = round(sum(s["gpu_ms"] for s in allg) / 1e3, 3)
    out.update(steps=len(step_log), decode_steps=len(dec),
               host_prepare_ms_median=round(sorted(s["host_prepare_s"] for s in step_log)[len(step_log) // 2] * 1e3,
                                            3))
    return out


def cbnb_run(model, tok, wl, cfg, *, graphs: bool, async_: bool, label: str, timeout_s: float) -> tuple[dict, Any]:
    """One cbnb run through `cbnb.bench.run_cbnb` with step profiling: (its record, the bench result)."""
    import torch

    from cbnb import bench

    cfg = cfg.copy(use_cuda_graph=graphs, use_async_batching=async_)
    holder: dict[str, Any] = {}

    def hook(eng):
        if SMOKE:  # the fake CUDA runner: graphs/async as this run asks (resolve() turned them off for the CPU)
            eng.runner.configure(eng.config, use_cuda_graph=graphs, use_async_batching=async_)
        eng.runner.profile = True
        holder["runner"] = eng.runner
        holder["memory_split"] = eng.memory_split()

    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = bench.run_cbnb(model, tok, wl, cfg, name=f"cbnb[{label}]", on_engine=hook, timeout_s=timeout_s)
    runner = holder.pop("runner", None)
    run = r.extra.get("stats", {}).get("run", {})
    split = holder.get("memory_split") or {}
    est = sum(v for k, v in split.items() if k != "swap_pool")
    entry = {"requests": wl.num_requests,
             "seconds": round(r.seconds, 3), "output_tokens": r.output_tokens, "tok_per_s": round(r.tok_per_s, 1),
             "error": r.error, "peak_allocated_bytes": r.peak_bytes,
             "peak_reserved_bytes": torch.cuda.max_memory_reserved() if DEV == "cuda" else None,
             "memory_split": split, "sizing_estimate_bytes": est,
             "peak_over_estimate": round(r.peak_bytes / est, 3) if est and DEV == "cuda" else None,
             "graph_counts": (run.get("cuda_graph_captures"), run.get("cuda_graph_replays"),
                              run.get("cuda_graph_capture_failures")),
             "steps": run.get("steps"), "runner": type(runner).__name__,
             "effective": runner.describe() if hasattr(runner, "describe") else {},
             "per_step": floor_report(getattr(runner, "step_log", []), sum(
                 p.numel() * p.element_size() for p in model.parameters()), read_json(part_path(
                     ARGS.out, "probe")).get("measured_bw"))}
    del runner, holder
    free_memory()
    return entry, r


def save_tokens(name: str, tokens: list[list[int]]) -> None:
    write_json(os.path.join(ARGS.out, "parts", f"tokens_{name}.json"), {"tokens": tokens})


# ------------------------------------------------------------------------------------------------ 2-3. headline
def part_headline_cbnb() -> dict[str, Any]:
    model, tok = headline_model()
    vocab = model.get_input_embeddings().num_embeddings
    RES["runs"] = {}
    # the side-by-side partner of hf-cb first (the comparison), then the full workload (the tok/s target)
    for label, scale in (("side_by_side", ARGS.hf_scale), ("full", ARGS.scale)):
        if left() < 5:
            RES["runs"][label] = {"skipped": f"{left():.0f} s left in this part"}
            continue
        wl, cfg = nanovllm(vocab, scale)
        entry, r = cbnb_run(model, tok, wl, cfg, graphs=True, async_=True, label=label, timeout_s=left())
        entry["scale"] = scale
        RES["runs"][label] = entry
        save_tokens(f"cbnb_{label}", r.tokens)
        log(label, {k: v for k, v in entry.items() if k not in ("effective", "memory_split", "per_step")})
        publish()
    return RES


def part_headline_hf() -> dict[str, Any]:
    from cbnb import bench

    model, _ = headline_model()
    wl, cfg = nanovllm(model.get_input_embeddings().num_embeddings, ARGS.hf_scale)
    RES["hf_cb"] = {"scale": ARGS.hf_scale, "requests": wl.num_requests, "running": True}
    publish()
    # collection stops 10 s before this part's deadline: the manager's stop and the figures fit before the cap
    r = bench._guard("hf-cb", lambda: bench.run_hf_cb(model, wl, cfg, timeout_s=max(5.0, left() - 10)))
    RES["hf_cb"] = {"scale": ARGS.hf_scale, "requests": wl.num_requests, "seconds": round(r.seconds, 3),
                    "output_tokens": r.output_tokens, "tok_per_s": round(r.tok_per_s, 1),
                    "finished_requests": sum(1 for t in r.tokens if t), "peak_allocated_bytes": r.peak_bytes,
                    "error": r.error}
    save_tokens("hf_cb", r.tokens)
    log("hf-cb", RES["hf_cb"])
    RES["ok"] = r.error is None
    return RES


# ------------------------------------------------------------------------------------------------ 4. sync debug
def part_sync_debug() -> dict[str, Any]:
    import cbnb

    model, _ = headline_model()
    vocab = model.get_input_embeddings().num_embeddings
    rng = random.Random(5)
    prompts = [[rng.randrange(32, vocab) for _ in range(rng.randint(16, 160 if not SMOKE else 40))]
               for _ in range(16 if not SMOKE else 6)]
    # sampled, sampled with the engine seed, greedy; and per-request logits processors, logprobs and min-p
    procs = [dict(repetition_penalty=1.2, no_repeat_ngram_size=3, logprobs=5),
             dict(frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: -5.0}, min_p=0.05, do_sample=True,
                  seed=9), dict(bad_words_ids=[[11], [12, 13]], sequence_bias={(14, 15): 2.0}, min_new_tokens=4),
             {}]
    kinds = [dict(dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=i) if i % 3 == 0 else
                  dict(do_sample=True, temperature=1.1) if i % 3 == 1 else {}, **procs[i % 4])
             for i in range(len(prompts))]
    cfg = cbnb.ContinuousBatchingConfig(page_size=16 if SMOKE else 64, num_blocks=256,
                                        max_batch_tokens=128 if SMOKE else 1024, max_requests_per_batch=32)
    mode = os.environ.get("CBNB_SYNC_DEBUG")
    RES.update(mode=mode if DEV == "cuda" else f"{mode} (no effect on CPU: the code path runs, nothing is checked)")
    eng = cbnb.Engine(model, config=cfg)
    with eng:
        hs = [eng.submit(p, max_new_tokens=24, ignore_eos=True, **k) for p, k in zip(prompts, kinds)]
        outs = [h.result(timeout=max(5.0, left())) for h in hs]
        RES["effective"] = eng.runner.describe() if hasattr(eng.runner, "describe") else {}
        RES["graph_counts"] = (eng.stats()["run"]["cuda_graph_captures"], eng.stats()["run"]["cuda_graph_replays"])
    errors = sorted({o.error for o in outs if o.state.name != "FINISHED"})
    RES.update(requests=len(outs), finished=sum(o.state.name == "FINISHED" for o in outs),
               sampled=sum(bool(k.get("do_sample")) for k in kinds),
               with_processors=sum(bool(procs[i % 4]) for i in range(len(kinds))),
               logprobs_ok=all(len(o.logprobs) == len(o.token_ids) for o, k in zip(outs, kinds) if "logprobs" in k),
               errors=errors[:3], ok=not errors)
    log("sync_debug", {k: RES[k] for k in ("mode", "requests", "finished", "with_processors", "logprobs_ok",
                                            "errors", "graph_counts")})
    return RES


# ------------------------------------------------------------------------------------------------ 5. kernels
def part_kernels() -> dict[str, Any]:
    if os.environ.get("CBNB_ATTENTION") == "torch":
        return {"skipped": "Triton cannot launch here (see probe): no kernels to check", "ok": True}
    sms = read_json(part_path(ARGS.out, "probe")).get("sms") or 132
    return gpu_check_kernels.run(SMOKE, DEV, sms, log, publish)


# ------------------------------------------------------------------------------------------------ engine vs generate
def gen_reference(model, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_tokens(model, prompts, n, cfg, describe: dict | None = None) -> list[list[int]]:
    import cbnb

    eng = cbnb.Engine(model, config=cfg)
    try:
        with eng:
            hs = [eng.submit(p, max_new_tokens=n, eos_token_id=-1, ignore_eos=True) for p in prompts]
            outs = [h.result(timeout=max(5.0, left())) for h in hs]
        if describe is not None and hasattr(eng.runner, "describe"):
            describe.update(eng.runner.describe(), runner=type(eng.runner).__name__)
    finally:
        del eng
        free_memory()
    bad = [o for o in outs if o.state.name != "FINISHED"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests not FINISHED: {bad[0].error}")
    return [o.token_ids for o in outs]


def no_eos(model) -> None:
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None


def part_fp32_tiny() -> dict[str, Any]:
    import cbnb

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 13, 17, 30, 47, 60, 90, 3)]
    RES["models"] = {}
    small = dict(page_size=16, num_blocks=256, max_requests_per_batch=64, max_batch_tokens=512,
                 kv_padding_interval_size=512)
    configs = [("graphs_async_chunked", cbnb.ContinuousBatchingConfig(**{**small, "max_batch_tokens": 32,
                                                                         "kv_padding_interval_size": 64},
                                                                      q_padding_interval_size=16)),
               ("graphs_sync", cbnb.ContinuousBatchingConfig(**small, use_async_batching=False)),
               ("eager", cbnb.ContinuousBatchingConfig(**small, use_cuda_graph=False))]
    names = ("tiny:gemma3",) if SMOKE else ("tiny:llama", "tiny:qwen3", "tiny:gemma3", "tiny:mistral")
    for name in names:
        if left() < 5:
            RES["models"][name] = {"skipped": f"{left():.0f} s left"}
            continue
        model, _ = load(name, "float32")
        no_eos(model)
        refs = [gen_reference(model, p, 24) for p in prompts]
        per = RES["models"][name] = {}
        # every variant on a pure full-attention and a hybrid sliding model; graphs + async on the other two
        for label, cfg in configs[: 1 if SMOKE or name in ("tiny:qwen3", "tiny:mistral") else 3]:
            d: dict[str, Any] = {}
            toks = engine_tokens(model, prompts, 24, cfg, d)
            per[label] = {"identical_share": sum(t == r for t, r in zip(toks, refs)) / len(refs),
                          **{k: d.get(k) for k in ("runner", "attention", "graphs", "async", "captures", "replays",
                                                   "carried_tokens")}}
            log(name, label, per[label])
            publish()
        del model
        free_memory()
    done = [v for per in RES["models"].values() for v in per.values() if "identical_share" in v]
    RES["all_identical"] = bool(done) and all(v["identical_share"] == 1.0 for v in done)
    return RES


def divergence_stats(pairs: list[tuple[list[int], list[int]]], n: int) -> dict[str, Any]:
    """First index where engine and reference tokens differ (n: never within n tokens), over requests."""
    first = sorted(next((i for i, (a, b) in enumerate(zip(t[:n], r[:n])) if a != b), n) for t, r in pairs)
    q = lambda f: first[min(len(first) - 1, int(f * len(first)))]  # noqa: E731
    return {"identical_share": round(sum(f == n for f in first) / len(first), 3),
            "first_divergence": {"min": first[0], "p10": q(0.1), "p25": q(0.25), "p50": q(0.5), "p75": q(0.75),
                                 "p90": q(0.9), "max": first[-1], "mean": round(sum(first) / len(first), 2)},
            "histogram": {str(i): first.count(i) for i in sorted(set(first))}}


def part_bf16_agreement() -> dict[str, Any]:
    import cbnb

    n_tok = 16
    RES.update(tokens=n_tok, reference="per-request model.generate in bf16 (same dtype)", models={})
    models = (("tiny:llama", 4, 512),) if SMOKE else (("shape:qwen3-0.6b", 48, 151936), ("tiny:llama", 32, 512),
                                                       ("tiny:gemma3", 32, 512))
    for name, n_req, vocab in models:
        if left() < 5:
            RES["models"][name] = {"skipped": f"{left():.0f} s left"}
            continue
        model, _ = load(name, "bfloat16")
        no_eos(model)
        rng = random.Random(3)
        prompts = [[rng.randrange(32, vocab) for _ in range(rng.randint(16, 160))] for _ in range(n_req)]
        refs = [gen_reference(model, p, n_tok) for p in prompts]
        cfg = cbnb.ContinuousBatchingConfig(page_size=256 if name.startswith("shape") else 16, num_blocks=256,
                                            max_batch_tokens=2048, max_requests_per_batch=64)
        d: dict[str, Any] = {}
        toks = engine_tokens(model, prompts, n_tok, cfg, d)
        RES["models"][name] = {"requests": n_req, **divergence_stats(list(zip(toks, refs)), n_tok),
                               "graphs": d.get("graphs"), "async": d.get("async")}
        log(name, RES["models"][name])
        publish()
        del model
        free_memory()
    return RES


# ------------------------------------------------------------------------------------------------ 8. variants
def part_variants() -> dict[str, Any]:
    from cbnb import bench

    model, tok = headline_model()
    wl, cfg = nanovllm(model.get_input_embeddings().num_embeddings, ARGS.scale)
    head = read_json(os.path.join(ARGS.out, "parts", "tokens_cbnb_full.json")).get("tokens")
    RES.update(scale=ARGS.scale, variants={})
    last = None
    for label, graphs, async_ in (("graphs_on_async_off", True, False), ("graphs_off_async_off", False, False),
                                  ("graphs_off_async_on", False, True)):
        est = 30.0 if last is None else last * (2.5 if not graphs else 1.2)  # eager is slower
        if left() < est:
            RES["variants"][label] = {"skipped": f"{left():.0f} s left, needs ~{est:.0f} s"}
            publish()
            continue
        t0 = time.time()
        entry, r = cbnb_run(model, tok, wl, cfg, graphs=graphs, async_=async_, label=label, timeout_s=left())
        last = time.time() - t0
        if head:
            entry["greedy_identical_vs_headline"] = bench.agreement(bench.PeerResult("h", 0, 0, 0, head), r)
        RES["variants"][label] = entry
        log(label, {k: v for k, v in entry.items() if k not in ("effective", "memory_split", "per_step")})
        publish()
    return RES


PARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "probe": part_probe, "headline_cbnb": part_headline_cbnb, "headline_hf": part_headline_hf,
    "sync_debug": part_sync_debug, "kernels": part_kernels, "fp32_tiny": part_fp32_tiny,
    "bf16_agreement": part_bf16_agreement, "variants": part_variants,
}


def main(argv: list[str] | None = None) -> int:
    global ARGS, DEV, SMOKE, T_END
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--cap", type=float, required=True, help="seconds before this process is stopped")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--hf-scale", type=float, default=0.25)
    ap.add_argument("--cpu-smoke", action="store_true")
    ARGS = ap.parse_args(argv)
    if ARGS.cpu_smoke:
        DEV, SMOKE = "cpu", True
    T_END = time.time() + ARGS.cap - MARGIN_S
    t0 = time.time()
    try:
        res = PARTS[ARGS.part]()
        RES.update(res or {})
        RES.setdefault("ok", True)
    except Exception as e:  # recorded; the orchestrator goes on with the next part
        RES.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        log(f"!! {ARGS.part} failed: {type(e).__name__}: {e}")
        log(traceback.format_exc())
    RES["part_seconds"] = round(time.time() - t0, 1)
    publish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
