"""`python -m cbnb.bench.profile`: where a cbnb step's time goes (torch.profiler per op), for speed work.

Runs one workload through cbnb and profiles, in the engine thread, every step: the per-op table of the first
prefill-only step (on cpu-32 a full 512-token chunk) and of the first step where every request decodes, and for the
whole run the share of each category (GEMM, attention, elementwise, KV writes, other ops) plus what no op accounts
for (the compiled attention kernels and the C layer ops, timed apart, and Python between ops). Times are the profiler's
(wall clock inside ops); on a shared machine compare shares and op counts, not seconds. ``--threads 1`` gives the most
repeatable picture. Example::

    python -m cbnb.bench.profile --workload cpu-32 --threads 1
"""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ["main", "profile_run", "category"]

_ELEMENTWISE = {"mul", "add", "silu", "pow", "mean", "rsqrt", "neg", "cat", "sum", "div", "div_", "_to_copy",
                "copy_", "sub", "exp", "where", "masked_fill", "embedding"}


def category(op: str) -> str:
    """The category of an ATen op name (e.g. "aten::mm" -> "gemm"; the CPU runner's linears are
    "mkldnn::_linear_pointwise", `cbnb.runner.cpu.cpu_linear`)."""
    name = op.split("::")[-1]
    if name in ("mm", "addmm", "bmm", "baddbmm", "_linear_pointwise"):
        return "gemm"
    if "attention" in name:
        return "attention (sdpa)"
    if name in ("index_copy_", "index_put_", "index_select", "index"):
        return "kv write/gather"
    if name in _ELEMENTWISE:
        return "elementwise"
    return "other ops"


def profile_run(args: argparse.Namespace) -> dict[str, Any]:
    """Profile every step of one run; returns the per-step tables and the whole-run categories (seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..core.config import ContinuousBatchingConfig
    from ..engine.engine import Engine
    from ..engine.models import load_model
    from ..runner.cpu import cpu_kernels, layer_ops
    from ..lab.workloads import get_workload

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model or get_workload(args.workload).model, dtype="float32", device="cpu")
    wl = get_workload(args.workload, vocab_size=model.get_input_embeddings().num_embeddings, scale=args.scale)
    cfg = ContinuousBatchingConfig(**wl.config_hints)
    eng = Engine(model, tokenizer=tok, config=cfg)
    totals: dict[str, list] = {}
    picked: dict[str, Any] = {}
    acc = {"wall": 0.0, "kernel": 0.0, "prefill_kernel": 0.0, "layer_ops": 0.0, "steps": 0}
    # The C calls are invisible to the profiler: time them apart (module attributes, looked up at each call).
    patched = [(cpu_kernels, "paged_decode", "kernel"), (cpu_kernels, "paged_prefill", "prefill_kernel")] + [
        (layer_ops, n, "layer_ops") for n in layer_ops.__all__ if n != "available"]
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]

    def timed(real, slot):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                acc[slot] += time.perf_counter() - t0
        return call

    execute = eng.runner.execute

    def profiled(work):
        sch = work.plan.scheduled
        n = sum(s.num_tokens for s in sch)
        kind = None
        if all(s.num_tokens > 1 for s in sch):
            kind = "prefill"
        elif len(sch) == wl.num_requests and all(s.num_tokens == 1 for s in sch):
            kind = "decode"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            result = execute(work)
            dt = time.perf_counter() - t0
        acc["wall"] += dt
        acc["steps"] += 1
        table = prof.key_averages()
        for e in table:
            d = totals.setdefault(e.key, [0.0, 0])
            d[0] += e.self_cpu_time_total / 1e6
            d[1] += e.count
        if kind and kind not in picked:
            picked[kind] = {"tokens": n, "rows": len(sch), "wall_s": dt,
                            "table": table.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                 max_name_column_width=48)}
        return result

    eng.runner.execute = profiled
    for (mod, name, slot), (_, _, real) in zip(patched, originals):
        setattr(mod, name, timed(real, slot))
    try:
        with eng:
            eng.generate([wl.prompts[0][:8]], max_new_tokens=2, ignore_eos=True)  # warm-up, profiled apart
            totals.clear()
            picked.clear()  # the tables show the workload's own steps, not the warm-up's
            acc.update(wall=0.0, kernel=0.0, prefill_kernel=0.0, layer_ops=0.0, steps=0)
            handles = [eng.submit(p, max_new_tokens=n, ignore_eos=True)
                       for p, n in zip(wl.prompts, wl.max_new_tokens)]
            for h in handles:
                h.result()
    finally:
        for mod, name, real in originals:
            setattr(mod, name, real)
    ops = sum(v[0] for v in totals.values())
    cats: dict[str, float] = {}
    for name, (t, _) in totals.items():
        cats[category(name)] = cats.get(category(name), 0.0) + t
    cats["decode kernel (C)"] = acc["kernel"]
    cats["prefill kernel (C)"] = acc["prefill_kernel"]
    cats["layer ops (C)"] = acc["layer_ops"]
    cats["python / between ops"] = max(0.0, acc["wall"] - ops - acc["kernel"] - acc["prefill_kernel"]
                                       - acc["layer_ops"])
    return {"steps": acc["steps"], "wall_s": acc["wall"], "categories": cats, "picked": picked,
            "threads": torch.get_num_threads(), "kernel": cpu_kernels.available()}


def main(argv: list[str] | None = None) -> int:
    from ..lab.workloads import WORKLOADS

    ap = argparse.ArgumentParser(prog="python -m cbnb.bench.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="cpu-32", choices=WORKLOADS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", type=int, default=15, help="ops per step table")
    args = ap.parse_args(argv)
    r = profile_run(args)
    print(f"{r['steps']} steps, {r['wall_s']:.2f} s in steps, {r['threads']} threads, decode kernel "
          f"{'on' if r['kernel'] else 'off'}")
    for name, t in sorted(r["categories"].items(), key=lambda x: -x[1]):
        print(f"  {name:<24}{t:>8.2f} s {100 * t / r['wall_s']:>5.0f} %")
    for kind, p in r["picked"].items():
        print(f"\n{kind} step: {p['tokens']} tokens, {p['rows']} requests, {p['wall_s'] * 1e3:.0f} ms")
        print(p["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
