"""`python -m cbnb.bench`: cbnb against its peers, side by side, in one process and one run.

Peers on the same workload and the same `ContinuousBatchingConfig` values:

- ``cbnb``: this engine;
- ``hf-cb``: transformers' own continuous batching (`init_continuous_batching` + `add_request`, which also allows a
  different `max_new_tokens` per request);
- ``hf-static``: static batched `model.generate` (left padding, batches of ``--static-batch`` requests).

It prints output tokens/s for each, the ratios against cbnb, peak memory during each run (RSS on CPU, allocated
bytes on CUDA), and whether the greedy tokens agree request by request. Speed claims come from here, never from a
timed test. Examples::

    python -m cbnb.bench --workload cpu-32
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants telemetry=off,telemetry=on
    python -m cbnb.bench --workload nanovllm-256 --model shape:qwen3-0.6b --peers cbnb,hf-cb
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["main", "run_bench", "PeerResult"]


@dataclass
class PeerResult:
    """One peer's run: wall seconds, tokens, memory peak, per-request tokens and extra figures."""

    name: str
    seconds: float
    output_tokens: int
    peak_bytes: int
    tokens: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


class _PeakMemory:
    """Samples process RSS (CPU) or reads the CUDA allocator peak during a `with` block."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> "_PeakMemory":
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return self
        import psutil

        proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = proc.memory_info().rss

        def sample() -> None:
            while not self._stop.wait(0.05):
                self.peak = max(self.peak, proc.memory_info().rss)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._t.join()


def _config_from(hints: dict[str, Any], args: argparse.Namespace):
    from .config import ContinuousBatchingConfig

    kw = dict(hints)
    for name in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
                 "safety_margin", "cpu_offload_space"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "no_sharing", False):
        kw["allow_block_sharing"] = False
    return ContinuousBatchingConfig(**kw)


def run_cbnb(model, tokenizer, workload, config, *, name: str = "cbnb", engine_kwargs: dict | None = None,
             on_engine: Callable[[Any], Any] | None = None, timeout_s: float | None = None) -> PeerResult:
    """Run the workload through a fresh cbnb `Engine` (after a one-request warm-up).

    With `timeout_s`, requests unfinished that many seconds after the submission are cancelled and the result is
    partial: the tokens produced until then, over that time, with `error` saying so."""
    import torch

    from .engine import Engine

    eng = Engine(model, tokenizer=tokenizer, config=config, **(engine_kwargs or {}))
    device = eng.device.type
    attach = on_engine(eng) if on_engine is not None else None
    with eng:
        eng.generate([workload.prompts[0][:8]], max_new_tokens=2, ignore_eos=True)  # warm-up
        if hasattr(eng, "reset_stats"):
            eng.reset_stats()
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            handles = [eng.submit(p, max_new_tokens=n, ignore_eos=True)
                       for p, n in zip(workload.prompts, workload.max_new_tokens)]
            outs, cut_at = _results_until(handles, t0, timeout_s)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = cut_at if cut_at is not None else time.perf_counter() - t0
        extra: dict[str, Any] = {"config": eng.config.to_dict()}
        if hasattr(eng, "stats"):
            with contextlib.suppress(Exception):
                extra["stats"] = eng.stats()
    if attach is not None and hasattr(attach, "close"):
        attach.close()
    bad = [o for o in outs if o.state.name != "FINISHED"]
    err = f"{len(bad)} requests not FINISHED: {bad[0].error}" if bad else None
    if cut_at is not None:
        err = f"timed out after {timeout_s:.0f} s: {len(outs) - len(bad)} of {len(outs)} requests finished"
    return PeerResult(name, dt, sum(len(o.token_ids) for o in outs), mem.peak, [o.token_ids for o in outs],
                      extra, err)


def _results_until(handles: list[Any], t0: float, timeout_s: float | None) -> tuple[list[Any], float | None]:
    """Every handle's output; past `timeout_s` after `t0` the unfinished ones are cancelled (their outputs keep the
    tokens produced so far). Returns (outputs, seconds until the timeout, or None when all finished in time)."""
    if timeout_s is None:
        return [h.result() for h in handles], None
    for h in handles:
        try:
            h.result(timeout=max(0.0, t0 + timeout_s - time.perf_counter()))
        except TimeoutError:
            dt = time.perf_counter() - t0
            for other in handles:
                other.cancel()
            return [other.result(timeout=60) for other in handles], dt
    return [h.result() for h in handles], None


def run_hf_cb(model, workload, config, *, timeout_s: float | None = None) -> PeerResult:
    """transformers' continuous batching with the same config values. With `timeout_s`, results are collected for
    that many seconds at most: a partial result counts the requests finished by then, with `error` saying so."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device.type
    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(workload.max_new_tokens))
    hf_cfg = config.to_transformers()
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=hf_cfg)
    manager.start()
    try:
        rid = manager.add_request(workload.prompts[0][:8], max_new_tokens=2)
        _collect(manager, {rid})
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, request_id=f"b{i}")
                   for i, (p, n) in enumerate(zip(workload.prompts, workload.max_new_tokens))]
            results = _collect(manager, set(ids), timeout=3600.0 if timeout_s is None else timeout_s)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    tokens = [list(results[i].generated_tokens) if i in results else [] for i in ids]
    errors = [results[i].error for i in ids if i in results and results[i].error]
    missing = [i for i in ids if i not in results]
    err = None
    if errors or missing:
        err = f"{len(errors)} failed, {len(missing)} missing" + (f": {errors[0]}" if errors else "")
        if missing and timeout_s is not None and dt >= timeout_s:
            err = f"timed out after {timeout_s:.0f} s: {len(results)} of {len(ids)} requests finished"
    return PeerResult("hf-cb", dt, sum(len(t) for t in tokens), mem.peak, tokens, {}, err)


def _collect(manager, ids: set[str], timeout: float = 3600.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(ids) and time.monotonic() < deadline:
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                break
            continue
        if r.request_id in ids and r.is_finished():
            out[r.request_id] = r
    return out


def run_hf_static(model, workload, batch_size: int) -> PeerResult:
    """Static batched `generate` (left padding), `batch_size` requests per call."""
    import torch

    device = next(model.parameters()).device
    n_total = 0
    tokens: list[list[int]] = []
    with _PeakMemory(device.type) as mem:
        t0 = time.perf_counter()
        for s in range(0, workload.num_requests, batch_size):
            prompts = workload.prompts[s:s + batch_size]
            gens = workload.max_new_tokens[s:s + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(gens),
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            for i, n in enumerate(gens):
                tokens.append(out[i, width:width + n].tolist())
                n_total += n
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return PeerResult("hf-static", dt, n_total, mem.peak, tokens, {"batch_size": batch_size})


def agreement(a: PeerResult, b: PeerResult) -> float:
    """Share of requests whose tokens are identical in both runs."""
    if not a.tokens or len(a.tokens) != len(b.tokens):
        return 0.0
    return sum(x == y for x, y in zip(a.tokens, b.tokens)) / len(a.tokens)


PEERS = ("cbnb", "hf-cb", "hf-static")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the peers named in `args.peers` (plus cbnb variants) and return a JSON-able report."""
    import torch

    from .models import load_model
    from .workloads import get_workload

    if args.threads:
        torch.set_num_threads(args.threads)
    wl0 = get_workload(args.workload, scale=args.scale, seed=args.seed)
    model_name = args.model or wl0.model
    dtype = args.dtype or (wl0.dtype if not torch.cuda.is_available() and wl0.dtype == "float32" else None)
    model, tokenizer = load_model(model_name, dtype=dtype, device=args.device)
    vocab = model.get_input_embeddings().num_embeddings
    wl = get_workload(args.workload, vocab_size=vocab, scale=args.scale, seed=args.seed)
    config = _config_from(wl.config_hints, args)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    results: list[PeerResult] = []
    variants = [v for v in (args.variants or "").split(",") if v]
    for peer in peers:
        _release_memory()
        if peer == "cbnb":
            if variants:
                for v in variants:
                    _release_memory()
                    results.append(_run_variant(model, tokenizer, wl, config, v))
            else:
                results.append(run_cbnb(model, tokenizer, wl, config))
        elif peer == "hf-cb":
            results.append(_guard("hf-cb", lambda: run_hf_cb(model, wl, config)))
        elif peer == "hf-static":
            results.append(_guard("hf-static", lambda: run_hf_static(model, wl, args.static_batch or wl.num_requests)))
        else:
            raise SystemExit(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
    base = results[0]
    report = {
        "workload": wl.name, "model": model_name, "dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device), "threads": torch.get_num_threads(),
        "requests": wl.num_requests, "prompt_tokens": wl.prompt_tokens, "output_tokens": wl.output_tokens,
        "config": config.transformers_dict(),
        "peers": [{
            "name": r.name, "seconds": round(r.seconds, 3), "output_tok_per_s": round(r.tok_per_s, 2),
            "ratio_vs_first": round(r.tok_per_s / base.tok_per_s, 3) if base.tok_per_s else None,
            "peak_bytes": r.peak_bytes, "greedy_agreement_vs_first": round(agreement(base, r), 3),
            "error": r.error, **{k: v for k, v in r.extra.items() if k in ("stats", "batch_size", "variant")},
        } for r in results],
    }
    return report


def _release_memory() -> None:
    """Drop the previous peer's engine before the next one sizes its cache from free memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _guard(name: str, fn: Callable[[], PeerResult]) -> PeerResult:
    try:
        return fn()
    except Exception as e:  # a failing peer is reported, not fatal for the comparison
        return PeerResult(name, 0.0, 0, 0, [], {}, f"{type(e).__name__}: {e}")


def _run_variant(model, tokenizer, wl, config, variant: str) -> PeerResult:
    """A cbnb run with one named option, e.g. "telemetry=off" or "dashboard=on"."""
    key, _, val = variant.partition("=")
    on = val.lower() in ("1", "on", "true", "yes")
    kwargs: dict[str, Any] = {}
    hook = None
    if key == "telemetry":
        kwargs["telemetry"] = on
    elif key == "dashboard":
        if on:
            def hook(eng):
                from .ui.headless import attach_headless_dashboard

                return attach_headless_dashboard(eng)
    elif key in ("use_cuda_graph", "use_async_batching"):
        config = config.copy(**{key: on})
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    r = run_cbnb(model, tokenizer, wl, config, name=f"cbnb[{variant}]", engine_kwargs=kwargs, on_engine=hook)
    r.extra["variant"] = variant
    return r


def _print(report: dict[str, Any]) -> None:
    print(f"workload {report['workload']}: {report['requests']} requests, {report['prompt_tokens']} prompt tokens, "
          f"{report['output_tokens']} output tokens; model {report['model']} ({report['dtype']}, "
          f"{report['device']}, {report['threads']} threads)")
    cfg = report["config"]
    print("config: " + ", ".join(f"{k}={cfg[k]}" for k in ("page_size", "num_blocks", "max_batch_tokens")))
    print(f"{'peer':<24}{'seconds':>9}{'out tok/s':>11}{'vs first':>10}{'peak MiB':>10}{'same tokens':>13}  error")
    for p in report["peers"]:
        ratio = f"{p['ratio_vs_first']:.2f}x" if p["ratio_vs_first"] is not None else "-"
        print(f"{p['name']:<24}{p['seconds']:>9.2f}{p['output_tok_per_s']:>11.1f}{ratio:>10}"
              f"{p['peak_bytes'] / 2**20:>10.0f}{p['greedy_agreement_vs_first'] * 100:>12.0f}%  {p['error'] or ''}")


def build_parser() -> argparse.ArgumentParser:
    from .workloads import WORKLOADS

    ap = argparse.ArgumentParser(prog="python -m cbnb.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="cpu-32", choices=WORKLOADS)
    ap.add_argument("--model", default=None, help="model name for cbnb.load_model (default: the workload's)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--peers", default="cbnb,hf-cb,hf-static", help="comma list of cbnb, hf-cb, hf-static")
    ap.add_argument("--variants", default="", help="cbnb variants, e.g. telemetry=off,telemetry=on")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workload (0 < scale <= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--static-batch", type=int, default=0, help="hf-static batch size (default: all requests)")
    ap.add_argument("--page-size", dest="page_size", type=int)
    ap.add_argument("--num-blocks", dest="num_blocks", type=int)
    ap.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int)
    ap.add_argument("--max-requests-per-batch", dest="max_requests_per_batch", type=int)
    ap.add_argument("--scheduler-type", dest="scheduler_type")
    ap.add_argument("--safety-margin", dest="safety_margin", type=float)
    ap.add_argument("--cpu-offload-space", dest="cpu_offload_space", type=float)
    ap.add_argument("--no-sharing", action="store_true", help="allow_block_sharing=False")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments before any model is loaded (errors exit with argparse's usage message)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if not 0 < args.scale <= 1:
        ap.error(f"--scale must be in (0, 1]; got {args.scale}")
    bad = [p for p in (x.strip() for x in args.peers.split(",")) if p and p not in PEERS]
    if bad:
        ap.error(f"--peers: unknown {', '.join(map(repr, bad))}; choose from {', '.join(PEERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_bench(args)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
